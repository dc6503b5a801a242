"""The MLA drafter (SGLang's Eagle3DeepseekV2ForCausalLM, what Kimi K2.x is served with) and the drafter kinds.

* export vs. SGLang 0.5.23's own loader, for both kinds: tests/fixtures/sglang/drafter_weights.json was
  recorded by executing SGLang's model constructors and load_weights (record_drafter_weights.py beside it);
* the MLA attention vs. transformers' own DeepseekV3Attention on identical weights, with Kimi's yarn RoPE;
* training (the same TTT loop and loss), export -> reload, lossless in-process speculative decoding, all on a
  tiny DeepseekV3 target built from a config (Kimi's architecture: MLA, dense first layer, MoE);
* the kind/shape settings of DrafterConfig.from_target and the refusal of a single aux layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from tiny_world import TINY_TRAIN, char_chat_tokenizer, target_world, world_drafter, write_prompts
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from aerie.benchmark.speculative import greedy_generate, speculative_generate
from aerie.drafter.config import TrainConfig
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.eagle3.drafting import EagleProposer
from aerie.drafter_kinds.eagle3.layers import DrafterKVCache
from aerie.drafter_kinds.eagle3.mla_layer import MLAAttention, mla_softmax_scale
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.drafter_kinds.eagle3.ttt import ttt_unroll

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURE = Path(__file__).parent / "fixtures" / "sglang" / "drafter_weights.json"
# Kimi K2.5's RoPE (config.json rope_scaling, rope_theta 50000): yarn with factor 64 over a 4096 context.
KIMI_YARN = {
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TARGET = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=262144,
    rope_parameters={"rope_theta": 50000.0, **KIMI_YARN},
    tie_word_embeddings=False,
    initializer_range=0.1,
)
AUX = [1, 2, 4]
DRAFT_VOCAB = 128
NUM_SEQS, PROMPT_LEN, NEW_TOKENS = 64, 8, 24
EMBED_SCALE = 30.0


# ---------------------------------------------------------------------------------------------------------
# export vs. SGLang's loader (recorded)


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def _sglang_load_problems(rec: dict, exported: dict[str, torch.Tensor]) -> list[str]:
    """What would go wrong loading ``exported`` with the recorded SGLang mapping (empty: every parameter is
    filled exactly once with the right shape, the embeddings by the target, and nothing is dropped)."""
    problems = []
    filled: dict[str, list[tuple[int, int]]] = {name: [] for name in rec["params"]}
    for name, t in exported.items():
        entry = rec["checkpoint"].get(name)
        if entry is None:
            problems.append(f"{name}: never shown to SGLang's load_weights (it would drop or misplace it)")
            continue
        if list(t.shape) != entry["shape"]:
            problems.append(f"{name}: shape {list(t.shape)}, SGLang takes {entry['shape']}")
        if entry.get("dropped"):
            problems.append(f"{name}: ignored by SGLang")
        for fill in entry.get("fills", []):
            filled[fill["param"]].append(tuple(fill["rows"]))
    for param, shape in rec["params"].items():
        rows = sorted(filled[param])
        if param == "model.embed_tokens.weight":  # SGLang's EAGLE worker sets the target's (set_embed)
            if rows:
                problems.append("embed_tokens exported: the embeddings are the target's")
            continue
        if [r for a, b in rows for r in range(a, b)] != list(range(shape[0])):
            problems.append(f"{param}: rows {rows} do not fill its {shape[0]} rows exactly once")
    return problems


@pytest.mark.parametrize("kind", ["llama", "llama_eagle31", "mla", "mla_eagle31"])
def test_export_fills_every_sglang_parameter_exactly_once(kind, tmp_path):
    """Every parameter SGLang's model creates is filled exactly once with the right rows by the export (the
    embeddings by the target, as SGLang's worker does), and the export holds nothing SGLang would drop."""
    rec = _fixture()["kinds"][kind]
    torch.manual_seed(0)
    Eagle3Drafter(DrafterConfig(**rec["aerie_config"])).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert "embed_tokens.weight" not in exported
    assert _sglang_load_problems(rec, exported) == []
    assert Eagle3Drafter.from_pretrained(tmp_path).cfg == DrafterConfig(**rec["aerie_config"])  # config round trip
    for name in exported:  # d2t / t2d are consumed otherwise (hot_token_id, skipped)
        assert "fills" in rec["checkpoint"][name] or name in ("d2t", "t2d"), name

    # the check bites: a missing half of a fused/stacked projection, a transposed tensor, a stray tensor
    half = (
        "midlayer.self_attn.k_proj.weight"
        if kind.startswith("llama")
        else "midlayer.self_attn.kv_a_proj_with_mqa.weight"
    )
    assert any("rows" in p for p in _sglang_load_problems(rec, {k: v for k, v in exported.items() if k != half}))
    flipped = {**exported, "midlayer.mlp.down_proj.weight": exported["midlayer.mlp.down_proj.weight"].T}
    assert any("shape" in p for p in _sglang_load_problems(rec, flipped))
    assert _sglang_load_problems(rec, {**exported, "midlayer.self_attn.q_norm.weight": torch.ones(3)})

    config = json.loads((tmp_path / "config.json").read_text())
    for key in rec["config_attributes_read"]:  # what SGLang's constructors read, as recorded
        if key in rec["config_json"]:
            assert config.get(key) == rec["config_json"][key], key
    assert config["architectures"] == [rec["class"]]
    for key in ("fc_norm", "norm_output"):  # absent = false in both SGLang classes
        assert config.get(key, False) == rec["aerie_config"].get(key, False)


def test_recorded_sglang_mla_split_and_softmax_scale_match_ours():
    for kind in ("mla", "mla_eagle31"):
        rec = _fixture()["kinds"][kind]
        cfg = DrafterConfig(**rec["aerie_config"])
        h, n, v, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        # post_load_weights splits kv_b_proj [h*(n+v), L] per head: keys first, then values (our split order)
        assert rec["post_load_weights"]["w_kc"] == [h, n, L] and rec["post_load_weights"]["w_vc"] == [h, L, v]
        assert rec["post_load_weights"]["softmax_scaling"] == pytest.approx(mla_softmax_scale(cfg), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------
# the attention against transformers' DeepseekV3


def test_mla_attention_matches_transformers_deepseek_v3_with_kimi_yarn():
    """Same weights in our MLAAttention and transformers' DeepseekV3Attention (built 2H wide, as SGLang widens
    the q/kv down-projections): identical outputs, also far beyond yarn's original 4096 context."""
    H = 48
    tc = DeepseekV3Config(**{**TARGET, "hidden_size": H, "v_head_dim": 12, "q_lora_rank": 24})
    cfg = DrafterConfig.from_target(tc, DRAFT_VOCAB, AUX)
    assert cfg.attention == "mla" and cfg.rope_scaling["factor"] == 64.0 and cfg.rope_theta == 50000.0
    torch.manual_seed(0)
    ours = MLAAttention(cfg).eval()
    wide = DeepseekV3Config(**{**tc.to_dict(), "hidden_size": 2 * H})
    wide._attn_implementation = "eager"
    ref = DeepseekV3Attention(wide, layer_idx=0).eval()
    assert wide.rope_interleave  # Kimi's (and DeepSeek-V3's) interleaved rotary pairs
    weights = {k: v.clone() for k, v in ours.state_dict().items()}
    o_proj = weights.pop("o_proj.weight")  # theirs writes 2H: our H rows first, then other weights
    weights["o_proj.weight"] = torch.cat([o_proj, torch.randn_like(o_proj)])
    ref.load_state_dict(weights, strict=True)
    rotary = DeepseekV3RotaryEmbedding(wide)
    T = 12
    x = torch.randn(2, T, 2 * H)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for start in (0, 3000, 150_000):
        pos = (torch.arange(T) + start)[None].expand(2, T)
        with torch.no_grad():
            mine = ours(x, pos, None)
            theirs = ref(x, rotary(x, pos), mask)[0][..., :H]
        torch.testing.assert_close(mine, theirs, atol=2e-6, rtol=1e-5)
        assert mine.abs().max() > 0.05
    # the yarn softmax factor matters: without it the outputs differ
    ours.q_multiplier = 1.0
    with torch.no_grad():
        assert (ours(x, pos, None) - theirs).abs().max() > 1e-3


def sglang_rope_is_neox(config_json: dict) -> bool:
    """The rotary layout SGLang 0.5.23 gives an MLA attention built from ``config_json``: it parses the file with
    transformers (model_type deepseek_v3 -> DeepseekV3Config, whose rope_interleave defaults to True), and
    ``DeepseekV2AttentionMLA.__init__`` (srt/models/deepseek_v2.py:2166; kimi_k25_eagle3.py:91 builds it for the
    EAGLE-3 MLA drafter with the draft config) sets ``is_neox_style = not getattr(config, "rope_interleave", True)``.
    Not neox = rotate_gptj: pairs (x[2i], x[2i+1]) (srt/layers/rotary_embedding/rope_variant.py:495)."""
    return not getattr(as_deepseek_v3_config(config_json), "rope_interleave", True)


def as_deepseek_v3_config(config_json: dict, **changes) -> DeepseekV3Config:
    """config.json parsed by transformers as a DeepseekV3Config (what SGLang's get_config returns for it)."""
    fields = {k: v for k, v in {**config_json, **changes}.items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model("deepseek_v3", **fields)


@pytest.mark.parametrize("target_flag", ["absent", True, False])
def test_mla_drafter_trains_the_rope_layout_sglang_serves(target_flag, tmp_path):
    """DeepSeek-V3's and Kimi K2.x's config.json carry no ``rope_interleave`` (their remote configuration code
    predates it); SGLang then rotates interleaved pairs for the target and for a drafter whose export omits it.
    The drafter trains with its target's layout, exports it explicitly, and the exported config makes an MLA
    attention compute exactly what the drafter trained with."""
    raw = {k: v for k, v in DeepseekV3Config(**TARGET).to_dict().items() if k != "rope_interleave"}
    if target_flag != "absent":
        raw["rope_interleave"] = target_flag
    cfg = DrafterConfig.from_target(SimpleNamespace(**raw), DRAFT_VOCAB, AUX)  # as loop.build_drafter sizes it
    assert cfg.rope_interleave == (not sglang_rope_is_neox(raw))  # the layout SGLang serves the target with
    assert cfg.rope_interleave == (target_flag is not False)

    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.save_pretrained(tmp_path, dtype=None)
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["rope_interleave"] is cfg.rope_interleave  # written out, not left to a reader's default
    assert sglang_rope_is_neox(exported) == (not cfg.rope_interleave)
    # an export without the key is read back as SGLang reads it
    legacy = {k: v for k, v in exported.items() if k != "rope_interleave"}
    assert DrafterConfig.from_hf_config(legacy).rope_interleave == (not sglang_rope_is_neox(legacy))

    # numbers: the trained attention equals an MLA attention built from the exported config.json
    H = cfg.hidden_size
    served = as_deepseek_v3_config(exported, hidden_size=2 * H)
    served._attn_implementation = "eager"
    assert served.rope_interleave == (not sglang_rope_is_neox(exported))
    ref = DeepseekV3Attention(served, layer_idx=0).eval()
    ours = drafter.midlayer.self_attn.eval()
    weights = {k: v.clone() for k, v in ours.state_dict().items()}
    weights["o_proj.weight"] = torch.cat([weights["o_proj.weight"], torch.zeros_like(weights["o_proj.weight"])])
    ref.load_state_dict(weights, strict=True)
    T = 9
    x = torch.randn(1, T, 2 * H)
    pos = torch.arange(T)[None] + 700
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs = ref(x, DeepseekV3RotaryEmbedding(served)(x, pos), mask)[0][..., :H]
        torch.testing.assert_close(ours(x, pos, None), theirs, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# a tiny Kimi-shaped target, its data and a trained MLA drafter


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mla")
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(DeepseekV3Config(**TARGET)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)  # confident next-token distributions, like a trained LM's
        # a residual stream led by the token embedding: the next token depends mostly on the current one, a
        # pattern 64 short sequences can teach (a random 6-layer MoE's output is otherwise close to noise)
        target.model.embed_tokens.weight.mul_(EMBED_SCALE)
    return target_world(
        root,
        target,
        aux_layer_ids=AUX,
        draft_vocab=DRAFT_VOCAB,
        num_seqs=NUM_SEQS,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        id_prefix="kimi-toy",
    )


TRAIN = dict(TINY_TRAIN, epochs=6)


@pytest.fixture(scope="module")
def trained(world) -> dict:
    out = world["root"] / "drafter"
    result = train_drafter(
        world["shards"], world["vocab"], world["target_dir"], out, TrainConfig.of(**TRAIN), log=lambda _: None
    )
    return {"out": out, "eval": result}


def test_training_an_mla_drafter_reduces_loss(trained):
    """The TTT loop, loss and evaluation are the Llama drafter's; "auto" picks MLA for this DeepseekV3 target."""
    ev, out = trained["eval"], trained["out"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 16
    assert ev["heldout_loss"] < 0.6 * ev["untrained"]["heldout_loss"]
    assert ev["simulated_acceptance_length"] > ev["untrained"]["simulated_acceptance_length"] + 0.5
    losses = [
        e["loss"] for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if e["event"] == "train"
    ]
    assert losses[-1] < 0.8 * losses[0]
    hf = AutoConfig.from_pretrained(out)  # transformers reads it as a DeepseekV3Config with yarn RoPE
    assert isinstance(hf, DeepseekV3Config) and hf.q_lora_rank == 32 and hf.rope_parameters["factor"] == 64.0
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX and hf.draft_vocab_size == DRAFT_VOCAB


class Killed(Exception):
    pass


def test_mla_training_resumes_exactly_after_a_kill(world, trained, tmp_path):
    """The resume path is the Llama drafter's: killed after step 5, rerun, the same weights as uninterrupted."""

    def kill(step: int) -> None:
        if step == 5:
            raise Killed(step)

    cfg = TrainConfig.of(**{**TRAIN, "checkpoint_every": 2})
    with pytest.raises(Killed):
        train_drafter(
            world["shards"], world["vocab"], world["target_dir"], tmp_path, cfg, log=lambda _: None, on_step=kill
        )
    lines: list[str] = []
    train_drafter(world["shards"], world["vocab"], world["target_dir"], tmp_path, cfg, log=lines.append)
    assert any(line.startswith("resuming from") for line in lines)
    assert (tmp_path / "model.safetensors").read_bytes() == (trained["out"] / "model.safetensors").read_bytes()


def test_export_reload_round_trip_gives_identical_logits(world, trained, tmp_path):
    trained_model = Eagle3Drafter.from_pretrained(trained["out"])
    with pytest.raises(RuntimeError, match="without embed_tokens"):  # the export has none: they are the target's
        trained_model(torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    embed = world["target"].get_input_embeddings().weight
    model = Eagle3Drafter.from_pretrained(trained["out"], embed_tokens=embed).eval()
    model.save_pretrained(tmp_path, dtype=None)  # fp32 re-export: must round-trip bit-exactly
    again = Eagle3Drafter.from_pretrained(tmp_path, embed_tokens=embed).eval()
    s = world["seqs"][2]
    aux, ids = s["aux"].bfloat16().float()[None], s["ids"][None]
    n = ids.shape[1] - 1
    with torch.no_grad():
        a = model(model.project_aux(aux[:, :n]), ids[:, 1:], torch.arange(n)[None])
        b = again(again.project_aux(aux[:, :n]), ids[:, 1:], torch.arange(n)[None])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert {k: v for k, v in again.state_dict().items()}.keys() == model.state_dict().keys()


@pytest.mark.parametrize("eagle31", [False, True])
def test_mla_cache_and_ttt_unroll_equal_chained_inference(world, eagle31):
    """DrafterKVCache (benchmark) and TTTCache (training) carry the MLA kind unchanged: step k at row t of the
    unroll is the k-th chained draft, and incremental cached forwards equal one full forward."""
    model = world_drafter(world, fc_norm=eagle31, norm_output=eagle31)
    s = world["seqs"][3]
    aux, ids = s["aux"].bfloat16().float()[None], s["ids"][None]
    K, T = 3, ids.shape[1] - 5
    with torch.no_grad():
        steps = ttt_unroll(model, aux[:, :T], ids, torch.arange(T)[None], K)
        full, _ = model(model.project_aux(aux[:, :T]), ids[:, 1 : T + 1], torch.arange(T)[None])
        torch.testing.assert_close(full, steps[0], atol=1e-5, rtol=1e-5)
        for t in (0, 5, T - 1):
            cache = DrafterKVCache()
            logits, hidden = model(
                model.project_aux(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1)[None], cache
            )
            torch.testing.assert_close(logits[:, -1], steps[0][:, t], atol=1e-5, rtol=1e-5)
            h = hidden[:, -1:]
            for k in range(1, K):
                logits, h = model(h, ids[:, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), cache)
                torch.testing.assert_close(logits[:, -1], steps[k][:, t], atol=1e-5, rtol=1e-5)


def test_speculative_decoding_with_an_mla_drafter_is_lossless(world, trained):
    target = world["target"]
    drafter = Eagle3Drafter.from_pretrained(trained["out"], embed_tokens=target.get_input_embeddings().weight).eval()
    accepted = 0
    for i in (0, 7, NUM_SEQS - 1):  # prompts the drafter trained or held out on
        prompt = world["seqs"][i]["ids"][None, :PROMPT_LEN]
        want = greedy_generate(target, prompt, max_new_tokens=20)
        got = speculative_generate(target, EagleProposer(drafter), prompt, max_new_tokens=20, num_draft_steps=3)
        assert got.tokens == want
        accepted += sum(got.accepted_per_step)
    assert accepted > 0  # the trained drafter's guesses do get used


# ---------------------------------------------------------------------------------------------------------
# kinds, shapes and refusals


def test_from_target_kinds_and_shapes(world):
    kimi_like = world["target"].config
    mla = DrafterConfig.from_target(kimi_like, DRAFT_VOCAB, AUX)
    assert (mla.attention, mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim) == ("mla", 32, 16, 16)
    llama = DrafterConfig.from_target(kimi_like, DRAFT_VOCAB, AUX, attention="llama")
    # a Llama drafter of an MLA target: the serving kernels' head_dim 128; 8 KV heads when the heads allow
    assert (llama.head_dim, llama.num_key_value_heads, llama.num_attention_heads) == (128, 4, 4)
    llama = DrafterConfig.from_target(
        kimi_like, DRAFT_VOCAB, AUX, attention="llama", num_attention_heads=16, intermediate_size=200
    )
    assert (llama.head_dim, llama.num_key_value_heads, llama.num_attention_heads, llama.intermediate_size) == (
        128,
        8,
        16,
        200,
    )
    small = DrafterConfig.from_target(
        kimi_like, DRAFT_VOCAB, AUX, attention="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    assert Eagle3Drafter(small).midlayer.self_attn.k_proj.weight.shape == (2 * 16, 2 * 64)
    with pytest.raises(ValueError, match="Llama-attention settings"):
        DrafterConfig.from_target(kimi_like, DRAFT_VOCAB, AUX, head_dim=64)
    with pytest.raises(ValueError, match="needs an MLA target"):
        DrafterConfig.from_target(LlamaConfig(hidden_size=64, num_attention_heads=4), DRAFT_VOCAB, AUX, attention="mla")
    assert DrafterConfig.from_target(LlamaConfig(hidden_size=64, num_attention_heads=4), 10, AUX).attention == "llama"


def test_a_single_aux_layer_is_refused_with_the_reason(world):
    with pytest.raises(ValueError, match=r"at least two target layers.*skips fc"):
        DrafterConfig.from_target(world["target"].config, DRAFT_VOCAB, [3])
    with pytest.raises(ValueError, match="at least two"):
        DrafterConfig.from_target(LlamaConfig(hidden_size=64, num_attention_heads=4), 10, [2], attention="llama")


def test_kimi_drafter_shapes():
    """The drafter sizes for Kimi K2.5's text config (its config.json values, no weights)."""
    kimi = DeepseekV3Config(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={"rope_theta": 50000.0, **KIMI_YARN},
    )
    mla = DrafterConfig.from_target(kimi, 32000, [1, 29, 57])
    assert (mla.attention, mla.num_attention_heads, mla.intermediate_size) == ("mla", 64, 18432)
    assert mla_softmax_scale(mla) == pytest.approx((1 + 0.1 * math.log(64)) ** 2 / math.sqrt(192))
    llama = DrafterConfig.from_target(kimi, 32000, [1, 29, 57], attention="llama")
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (64, 8, 128)
    # Training reads the text config straight from config.json, where Kimi keeps the 4.x spelling
    raw = {k: v for k, v in kimi.to_dict().items() if k != "rope_parameters"}
    raw.update(
        rope_theta=50000.0, rope_scaling={"type": "yarn", **{k: v for k, v in KIMI_YARN.items() if k != "rope_type"}}
    )
    assert DrafterConfig.from_target(SimpleNamespace(**raw), 32000, [1, 29, 57]) == mla


# ---------------------------------------------------------------------------------------------------------
# the in-process benchmark


def test_run_benchmark_serves_an_mla_export_with_the_targets_embeddings(tmp_path):
    """run_benchmark loads an MLA export (no embeddings: it takes the target's) next to a DeepseekV3 target with a
    tokenizer and chat template, and decodes losslessly with it and with the untrained reference."""
    from aerie.benchmark.run import run_benchmark
    from aerie.benchmark.settings import BenchRun, TargetLoad

    tok, vocab = char_chat_tokenizer(["<unk>", "<s>", "<|user|>", "<|assistant|>", "<|end|>"])
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(
        DeepseekV3Config(**{**TARGET, "vocab_size": len(vocab), "eos_token_id": vocab["<|end|>"]})
    ).eval()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft = len(vocab) // 2
    d2t, t2d = torch.zeros(draft, dtype=torch.long), torch.zeros(len(vocab), dtype=torch.bool)
    t2d[:draft] = True
    cfg = DrafterConfig.from_target(target.config, draft, AUX)
    Eagle3Drafter.from_target(target, cfg, d2t, t2d).save_pretrained(tmp_path / "drafter")
    write_prompts(tmp_path / "bench.jsonl", ["sort 3 1 2", "hello there"])
    threads = torch.get_num_threads()
    try:
        report = run_benchmark(
            TargetLoad(tmp_path / "target", "cpu", "float32"),
            {"mla": tmp_path / "drafter"},
            [tmp_path / "bench.jsonl"],
            tmp_path / "bench.json",
            BenchRun(max_new_tokens=10, num_draft_steps=3, warmup=0, threads=1),
            log=lambda _: None,
        )
    finally:
        torch.set_num_threads(threads)
    assert report["lossless"] is True and set(report["methods"]) >= {"mla", "untrained"}
    assert report["drafters"]["mla"]["layer_ids"] == AUX and report["methods"]["mla"]["acceptance_length"] >= 1.0
