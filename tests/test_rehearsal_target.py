"""The Kimi-shaped rehearsal target: custom-code loading, Kimi's ids and vocabulary, the K2.5-style template,
DeepseekV3 MLA/MoE inside the wrapper, the exact live-vocabulary loss, hooks, and serving through the emulator."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from aerie.sources.synthetic import generate_prompts
from aerie.targets.demo.pretrain import completion_loss
from aerie.targets.rehearsal.build import REPORT_FILE, LiveVocabLoss, build_rehearsal_target
from aerie.targets.rehearsal.chat_template import DEFAULT_SYSTEM_PROMPT
from aerie.targets.rehearsal.config import VOCAB_SIZE, RehearsalTargetConfig
from aerie.targets.rehearsal.tokenizer import KIMI_SPECIAL_TOKEN_IDS, SPECIAL_TOKENS_START

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = RehearsalTargetConfig(
    bpe_ranks=600,
    tokenizer_examples=600,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=2048,
    yarn_original_max_position_embeddings=512,
    vision_hidden_size=8,
    train_steps=4,
    batch_size=4,
    warmup=2,
    log_every=2,
    eval_prompts=3,
    eval_max_new_tokens=8,
    eval_batch_size=3,
    latency_steps=2,
    threads=1,
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "city": {"type": "string", "description": "city name"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
            },
        },
    }
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rehearsal") / "target"
    build_rehearsal_target(out, TINY, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def loaded(target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(target), trust_remote_code=True).eval()
    return model, tok


def test_folder_is_kimi_shaped_and_loads_through_its_own_code(target, loaded) -> None:
    model, tok = loaded
    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    assert type(model).__module__.startswith("transformers_modules.")  # the folder's code, not aerie's
    assert type(tok).__name__ == "TikTokenTokenizer" and type(tok).__module__.startswith("transformers_modules.")
    for name in (
        "configuration_kimi_k25.py",
        "modeling_kimi_k25.py",
        "tokenization_kimi.py",
        "tiktoken.model",
        "chat_template.jinja",
        REPORT_FILE,
    ):
        assert (target / name).exists(), name
    assert not (target / "tokenizer.json").exists()  # like Kimi: tiktoken only

    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k25.KimiK25ForConditionalGeneration"
    text = cfg["text_config"]
    assert text["model_type"] == "deepseek_v3" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert text["vocab_size"] == VOCAB_SIZE and text["num_hidden_layers"] == TINY.num_hidden_layers
    # MLA
    assert (
        text["q_lora_rank"],
        text["kv_lora_rank"],
        text["qk_nope_head_dim"],
        text["qk_rope_head_dim"],
        text["v_head_dim"],
    ) == (32, 16, 16, 8, 16)
    assert text["rope_parameters"]["rope_type"] == "yarn"
    # MoE with a dense first layer and a shared expert
    assert (
        text["first_k_dense_replace"],
        text["n_routed_experts"],
        text["num_experts_per_tok"],
        text["n_shared_experts"],
    ) == (1, 4, 2, 1)
    layers = model.language_model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP" and type(layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert type(layers[0].self_attn).__name__ == "DeepseekV3Attention"
    assert hasattr(layers[0].self_attn, "kv_a_proj_with_mqa") and hasattr(layers[0].self_attn, "q_a_proj")

    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in keys  # per-expert, as checkpoints are
    assert any(k.startswith("vision_tower.") for k in keys) and "mm_projector.weight" in keys
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in keys)


def test_special_tokens_at_kimi_ids_in_kimis_vocabulary(target, loaded) -> None:
    model, tok = loaded
    assert len(tok) == VOCAB_SIZE == model.get_output_embeddings().weight.shape[0] == 163_840
    for token, i in KIMI_SPECIAL_TOKEN_IDS.items():
        assert tok.encode(token, add_special_tokens=False) == [i], token
        assert tok.convert_ids_to_tokens(i) == token
    assert tok.convert_tokens_to_ids("<|im_end|>") == 163586
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163585, 163839)
    # As Kimi's: [EOS] is the tokenizer's eos; the turn end stops generation through generation_config.
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == 163586
    decoder = json.loads((target / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert sorted(map(int, decoder)) == list(range(SPECIAL_TOKENS_START, VOCAB_SIZE))
    assert decoder["163590"]["content"] == "<|reserved_token_6|>"


def test_tiktoken_model_is_the_segmentation(target, loaded) -> None:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    _, tok = loaded
    lines = (target / "tiktoken.model").read_text().splitlines()
    ranks = load_tiktoken_bpe(str(target / "tiktoken.model"))
    assert [int(line.split()[1]) for line in lines] == list(range(len(lines))) == sorted(ranks.values())
    assert all(bytes([b]) in ranks for b in range(256))  # byte fallback: any text encodes
    assert base64.b64decode(lines[0].split()[0]) in ranks
    enc = tiktoken.Encoding("probe", pat_str=tok.model._pat_str, mergeable_ranks=ranks, special_tokens={})
    text = "Sort [12, 7, 3] in ascending order. Ünïcödé 世界 def f(x):\n    return x"
    assert tok.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    mixed = "r</think>a<|tool_calls_section_begin|><|im_end|>"
    ids = tok.encode(mixed, add_special_tokens=False)
    assert ids[1] == 163607 and ids[-2:] == [163595, 163586] and tok.decode(ids) == mixed


def test_generation_prompt_opens_think_and_thinking_switch(loaded) -> None:
    _, tok = loaded
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning_content": "r1"},
        {"role": "user", "content": "again"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>yo<|im_end|>"  # history: reasoning dropped
        "<|im_user|>user<|im_middle|>again<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    # ... <|im_assistant|> "assistant" <|im_middle|> <think>: <think> is the prompt's last id
    assert ids[-2:] == [163601, 163606] and tok.decode(ids[len(ids) - 1 - ids[::-1].index(163588) :]) == (
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    instant = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    assert instant.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    kept = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, preserve_thinking=True)
    assert "<think>r1</think>yo" in kept
    own = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "name": "bob", "content": "q"}], tokenize=False
    )
    assert own == "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>bob<|im_middle|>q<|im_end|>"


def test_tool_declarations_and_a_tool_call_turn(loaded) -> None:
    _, tok = loaded
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    declare, rest = text.split("<|im_end|>", 1)
    assert declare.startswith("<|im_system|>tool_declare<|im_middle|># Tools")
    assert "namespace functions {" in declare and "type get_weather = (_: {" in declare  # TypeScript-style
    assert '  unit?: "c" | "f",' in declare and "  city: string," in declare and "// Current weather" in declare
    assert rest.startswith(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>")
    # the current tool-call loop keeps its reasoning; the call is Kimi's section
    assert (
        "<|im_assistant|>assistant<|im_middle|><think>need the tool</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    ) in text
    assert text.endswith(
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for marker in (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ):
        assert ids.count(KIMI_SPECIAL_TOKEN_IDS[marker]) == 1, marker


def test_live_vocab_loss_is_the_full_vocabulary_loss(target, loaded) -> None:
    model, tok = loaded
    head = model.get_output_embeddings().weight
    report = json.loads((target / REPORT_FILE).read_text())
    n_ranks = report["tokenizer"]["bpe_ranks"]
    assert torch.count_nonzero(head[n_ranks:SPECIAL_TOKENS_START]) == 0  # never produced: zero rows
    assert torch.count_nonzero(head[:n_ranks]) > 0 and torch.count_nonzero(head[SPECIAL_TOKENS_START:]) > 0
    live = [*range(n_ranks), *range(SPECIAL_TOKENS_START, VOCAB_SIZE)]
    text = (
        tok.apply_chat_template(
            [{"role": "user", "content": "Compute 2 + 3."}], tokenize=False, add_generation_prompt=True
        )
        + "2 + 3 = 5.</think>The answer is 5.<|im_end|>"
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, -12:] = True
    loss = LiveVocabLoss(live, VOCAB_SIZE)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        fast = loss(model, ids, mask)
        full = completion_loss(model, ids, mask)
        with loss.compact(model):  # training mode: the matrices hold the live rows only
            assert model.get_output_embeddings().weight.shape[0] == len(live)
            compact = loss(model, ids, mask)
    assert model.get_input_embeddings().weight is embed and model.get_output_embeddings().weight.shape[0] == VOCAB_SIZE
    torch.testing.assert_close(compact, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)
    assert report["format"] == "aerie.rehearsal-target/1" and report["train"]["steps"] == TINY.train_steps
    assert report["metrics"]["eval_prompts"] == TINY.eval_prompts


def test_decoder_layer_hooks_see_deepseek_layer_outputs(loaded) -> None:
    """What aerie's capture relies on. As for any transformers wrapper with a ``language_model``,
    get_decoder() is the DeepseekV3ForCausalLM itself; unwrapping get_decoder() to its fixed point reaches
    the DeepseekV3Model, whose layer i output is output_hidden_states[i + 1] (SGLang's aux-id convention)."""
    from aerie.target_model.capture import base_decoder

    model, tok = loaded
    assert type(model.get_decoder()).__name__ == "DeepseekV3ForCausalLM"
    assert base_decoder(model) is model.language_model.model
    ids = torch.tensor([tok.encode(generate_prompts(["lists"], 1, 0)[0]["user"], add_special_tokens=False)])
    seen = {}
    layers = base_decoder(model).layers
    handles = [layers[i].register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out)) for i in (1, 2)]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    for h in handles:
        h.remove()
    for i in (1, 2):
        torch.testing.assert_close(seen[i][0] if isinstance(seen[i], tuple) else seen[i], ref[i + 1], atol=0, rtol=0)


def test_aerie_capture_hooks_the_wrapped_decoder(loaded) -> None:
    from aerie.target_model.capture import AuxHiddenCapture

    model, tok = loaded
    ids = torch.tensor([tok.encode("Compute 2 + 3.", add_special_tokens=False)])
    with torch.no_grad(), AuxHiddenCapture(model, [1, 2]) as cap:
        ref = model(ids, output_hidden_states=True).hidden_states
        aux = cap.aux_hidden_states()
    torch.testing.assert_close(aux, torch.cat([ref[2], ref[3]], dim=-1), atol=0, rtol=0)


def test_served_by_transformers_serve_behind_the_openrouter_emulator(target, loaded, tmp_path) -> None:
    """The emulator's upstream mode: the target's own text (as `transformers serve` generates it), in
    OpenRouter's envelope with the upstream's token counts, the provider's price and name."""
    import requests

    from aerie.emulator import EmulatorSettings, FakeProvider, serve_in_thread
    from aerie.target_model.serve import serve_on_loopback, transformers_serve_command

    _, tok = loaded
    messages = [{"role": "user", "content": generate_prompts(["arith"], 1, 3)[0]["user"]}]
    request = {"messages": messages, "max_tokens": 6, "temperature": 0.0}
    provider = FakeProvider("Cheap", "int4", 0.5e-6, 2.0e-6)
    with serve_on_loopback(
        lambda port: transformers_serve_command(str(target), port, trust_remote_code=True),
        "/health",
        tmp_path / "serve.log",
    ) as base:
        direct = requests.post(f"{base}/v1/chat/completions", json={"model": str(target), **request}, timeout=300)
        assert direct.status_code == 200, direct.text
        settings = EmulatorSettings(providers=[provider])
        with serve_in_thread(settings) as url:
            # Pointed upstream after the start, as the rehearsal does once the target's server is up.
            settings.upstream_url, settings.upstream_model, settings.upstream_tokenizer = (
                f"{base}/v1",
                str(target),
                str(target),
            )
            resp = requests.post(
                f"{url}/chat/completions",
                timeout=300,
                json={"model": "moonshotai/kimi-k2.5", **request, "provider": {"quantizations": ["int4"]}},
            )
    assert resp.status_code == 200, resp.text
    body, plain = resp.json(), direct.json()
    msg, plain_msg = body["choices"][0]["message"], plain["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == (plain_msg.get("reasoning_content"), plain_msg["content"] or "")
    assert body["provider"] == "Cheap" and body["model"] == "moonshotai/kimi-k2.5"
    usage = body["usage"]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(rendered, add_special_tokens=False)
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"] <= 6
    assert usage["cost"] == pytest.approx(usage["prompt_tokens"] * 0.5e-6 + usage["completion_tokens"] * 2.0e-6)
    assert body["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
