"""EAGLE-3 drafter: cache semantics, TTT attention pattern, training, SGLang-compatible export.

Everything runs on a tiny random Llama target whose greedy outputs are the training data, with hidden
shards written in the documented aerie.hidden/1 format from real forwards (aux via AuxHiddenCapture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_world import TINY_TRAIN, target_world, world_drafter, write_hidden_v1_shard
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from aerie.drafter.config import TrainConfig
from aerie.drafter.data import load_batch, make_windows
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.eagle3.layers import DrafterKVCache, TTTCache
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
from aerie.drafter_kinds.eagle3.ttt import ttt_unroll
from aerie.formats.hidden import HiddenShard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,  # peaked enough that bf16-stored features keep the same argmax
)
AUX_LAYER_IDS = [1, 2, 4]  # three layers: SGLang's fc is hard-wired to 3 * hidden
DRAFT_VOCAB = 128
NUM_SEQS = 96
NEW_TOKENS = 30
PROMPT_LEN = 8


# ---------------------------------------------------------------------------------------------------------
# fixtures: target, hidden shards, draft vocab


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("drafter")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET)).eval()
    with torch.no_grad():  # sharpen the head: confident next-token distributions, like a trained LM's
        target.lm_head.weight.mul_(5.0)
    # Greedy generation, all prompts at once (equal prompt lengths): the data the target itself produces.
    return target_world(
        root,
        target,
        aux_layer_ids=AUX_LAYER_IDS,
        draft_vocab=DRAFT_VOCAB,
        num_seqs=NUM_SEQS,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        id_prefix="toy",
    )


def _seq_inputs(world, i: int = 0):
    s = world["seqs"][i]
    aux = s["aux"].to(torch.bfloat16).float()[None]  # [1, n, 3H]
    return aux, s["ids"][None]


def test_shard_features_reproduce_target_logits(world):
    # Sanity of the fixture: lm_head(final) gives the target's logits, and argmax survives bf16 storage.
    s = world["seqs"][0]
    with torch.no_grad():
        logits = world["target"](s["ids"][None]).logits[0]
        from_final = world["target"].lm_head(s["final"].to(torch.bfloat16).float())
    assert torch.equal(logits.argmax(-1)[:-1], from_final.argmax(-1)[:-1])


# ---------------------------------------------------------------------------------------------------------
# (1) cache semantics and the inference pairing


@torch.no_grad()
def test_cached_incremental_forward_equals_full_forward(world):
    model = world_drafter(world)
    aux, ids = _seq_inputs(world)
    n = ids.shape[1] - 1
    hidden = model.project_aux(aux[:, :n])  # rows 0..n-1
    tokens, pos = ids[:, 1 : n + 1], torch.arange(n)[None]  # token t+1 at position t
    full_logits, full_hidden = model(hidden, tokens, pos)

    cache = DrafterKVCache()
    parts = [model(hidden[:, :5], tokens[:, :5], pos[:, :5], cache)]
    for a, b in [(5, 6), (6, 9), *[(t, t + 1) for t in range(9, n)]]:
        parts.append(model(hidden[:, a:b], tokens[:, a:b], pos[:, a:b], cache))
    assert len(cache) == n
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), full_hidden, atol=1e-5, rtol=1e-5)

    # crop drops rejected positions: recomputing after a crop gives the same rows again
    cache.crop(7)
    assert len(cache) == 7
    again, _ = model(hidden[:, 7:], tokens[:, 7:], pos[:, 7:], cache)
    torch.testing.assert_close(again, full_logits[:, 7:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ttt_unroll_equals_chained_inference(world):
    """Step k at row t of the training unroll is exactly the k-th chained draft after a prefix ending at t."""
    model = world_drafter(world)
    aux, ids = _seq_inputs(world, 3)
    K, T = 3, ids.shape[1] - 5
    steps = ttt_unroll(model, aux[:, :T], ids, torch.arange(T)[None], K)
    for t in (0, 4, T - 1):
        cache = DrafterKVCache()
        logits, hidden = model(model.project_aux(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1)[None], cache)
        torch.testing.assert_close(logits[:, -1], steps[0][:, t], atol=1e-5, rtol=1e-5)
        h = hidden[:, -1:]
        for k in range(1, K):
            logits, h = model(h, ids[:, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), cache)
            torch.testing.assert_close(logits[:, -1], steps[k][:, t], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# (5) the TTT attention mask


@torch.no_grad()
def _unroll_perturbed(model, aux, ids, K: int, perturb_step: int | None, rows: list[int]) -> list[torch.Tensor]:
    """Manual TTT unroll; noise is added to the hidden fed into `perturb_step` at `rows`.
    Returns hidden_out per step."""
    T = aux.shape[1]
    cache, hidden, outs = TTTCache(), model.project_aux(aux), []
    noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
    for k in range(K):
        if k == perturb_step:
            hidden = hidden.clone()
            hidden[:, rows] += noise[:, rows]
        _, hidden = model(hidden, ids[:, 1 + k : 1 + k + T], torch.arange(T)[None] + k, cache)
        outs.append(hidden)
    return outs


def test_ttt_step_rows_see_only_own_chain_and_causal_step0(world):
    model = world_drafter(world)
    aux, ids = _seq_inputs(world, 5)
    K, T, t = 4, 16, 9
    aux = aux[:, :T]
    base = _unroll_perturbed(model, aux, ids, K, None, [])
    others = [r for r in range(T) if r != t]
    for j in range(1, K):  # perturb other rows' step-j inputs: row t's steps >= j must not move
        out = _unroll_perturbed(model, aux, ids, K, j, others)
        for k in range(j, K):
            torch.testing.assert_close(out[k][:, t], base[k][:, t], atol=1e-6, rtol=0)
        own = _unroll_perturbed(model, aux, ids, K, j, [t])  # ... but its own row's must
        assert (own[K - 1][:, t] - base[K - 1][:, t]).abs().max() > 1e-3
    earlier = _unroll_perturbed(model, aux, ids, K, 0, [t - 3])  # an earlier step-0 row changes every step
    later = _unroll_perturbed(model, aux, ids, K, 0, [t + 2])  # a later one changes nothing (causal)
    for k in range(K):
        assert (earlier[k][:, t] - base[k][:, t]).abs().max() > 1e-3
        torch.testing.assert_close(later[k][:, t], base[k][:, t], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# (4) inconsistent shards are refused


def test_mismatched_aux_layer_ids_refused(world, tmp_path):
    other = tmp_path / "shard-other.safetensors"
    write_hidden_v1_shard(
        other,
        world["seqs"][:2],
        aux_layer_ids=[0, 2, 4],
        target_config=world["target"].config,
        target_dir=world["target_dir"],
    )
    with pytest.raises(ValueError, match=r"aux_layer_ids.*\[1, 2, 4\].*\[0, 2, 4\]"):
        train_drafter(
            [world["shards"][0], other], world["vocab"], world["target_dir"], tmp_path / "out", TrainConfig.of(epochs=1)
        )


# ---------------------------------------------------------------------------------------------------------
# (2) training


def test_long_sequences_are_cut_into_windows_with_lookahead(world, tmp_path):
    n, H = 150, TARGET["hidden_size"]
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:10] = False
    seq = {
        "id": "long/0",
        "ids": torch.randint(0, 300, (n,), generator=g),
        "mask": mask,
        "aux": torch.randn(n, 3 * H, generator=g),
        "final": torch.randn(n, H, generator=g),
    }
    path = tmp_path / "long.safetensors"
    write_hidden_v1_shard(
        path,
        [world["seqs"][0], seq],
        aux_layer_ids=AUX_LAYER_IDS,
        target_config=world["target"].config,
        target_dir=world["target_dir"],
    )
    shard = HiddenShard(path)
    s = int(shard.seq_offsets[1])
    windows = make_windows(0, shard, 1, max_len=64, lookahead=3 + 1)
    assert [(w.start - s, w.end - s, w.look_end - s, w.pos0) for w in windows] == [
        (0, 64, 68, 0),
        (64, 128, 132, 64),
        (128, 150, 150, 128),
    ]
    b = load_batch(windows, [shard], 3 + 1, torch.device("cpu"), torch.float32)
    assert b.ids.shape == (3, 64 + 3 + 2) and b.rows == n
    assert torch.equal(b.ids[1, :68], seq["ids"][64:132]) and int(b.position_ids[1, 0]) == 64
    assert torch.equal(b.aux[2, :22], seq["aux"][128:].bfloat16().float()) and not b.row_valid[2, 22:].any()
    assert torch.equal(b.gen[0, :68], mask[:68]) and not b.have[2, 22:].any()


def test_packed_batch_trains_and_evaluates_as_the_padded_one(world, tmp_path):
    """The same windows (three whole sequences and a long one cut into windows with look-ahead) packed into rows
    of 96 or one per row: the same loss, per-step statistics, every parameter's gradient, and the same held-out
    figures - packing changes the layout, not what is computed (each sequence attends to itself, and a row's
    steps read no later sequence's tokens)."""
    from aerie.drafter_kinds.eagle3.evaluate import evaluate
    from aerie.drafter_kinds.eagle3.ttt import TargetHead, ttt_forward

    n = 150
    g = torch.Generator().manual_seed(4)
    long = {"id": "long/0", "ids": torch.randint(0, 300, (n,), generator=g), "mask": torch.rand(n, generator=g) < 0.8,
            "aux": torch.randn(n, 3 * 64, generator=g), "final": torch.randn(n, 64, generator=g)}  # fmt: skip
    path = tmp_path / "mixed.safetensors"
    seqs = [*world["seqs"][:3], long]
    write_hidden_v1_shard(path, seqs, aux_layer_ids=AUX_LAYER_IDS, target_config=world["target"].config,
                          target_dir=world["target_dir"])  # fmt: skip
    shard = HiddenShard(path)
    windows = [w for q in range(4) for w in make_windows(0, shard, q, max_len=64, lookahead=3 + 1)]
    model = world_drafter(world).train()
    lm_head = world["target"].lm_head.weight.detach()
    head = TargetHead(full=lm_head, draft=lm_head[model.t2d], t2d=model.t2d)
    cfg = TrainConfig.of(ttt_steps=3, max_seq_len=96)
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for capacity in (None, 96):
        b = load_batch(windows, [shard], 3 + 1, torch.device("cpu"), torch.float32, capacity)
        loss, stats, _ = ttt_forward(model, b, head.prepare(b, cfg.mask_out_of_vocab_targets), 3, cfg.step_loss_decay)
        results.append((b, loss, stats, torch.autograd.grad(loss, params)))
    (padded, l0, s0, g0), (packed, l1, s1, g1) = results
    assert padded.seq_start is None and packed.seq_start is not None
    assert packed.ids.numel() < padded.ids.numel() and packed.rows == padded.rows
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for (c0, w0, r0), (c1, w1, r1) in zip(s0, s1):
        assert float(w1) == float(w0) and float(r1) == float(r0)
        torch.testing.assert_close(c1, c0, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(g0, g1):
        torch.testing.assert_close(b_, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
    cpu = torch.device("cpu")
    settings = TrainConfig.of(ttt_steps=3).kind_settings
    figures = [
        evaluate(
            model, [load_batch(windows, [shard], 3 + 1, cpu, torch.float32, capacity)], head, settings, "chunked", cpu
        )
        for capacity in (None, 96)
    ]
    assert figures[0]["heldout_start_positions"] == figures[1]["heldout_start_positions"] > 0
    assert figures[1]["simulated_acceptance_length"] == pytest.approx(figures[0]["simulated_acceptance_length"])
    assert figures[1]["heldout_loss"] == pytest.approx(figures[0]["heldout_loss"], rel=1e-5)


TRAIN = dict(TINY_TRAIN, epochs=10)


@pytest.fixture(scope="module")
def trained(world) -> dict:
    out = world["root"] / "drafter"
    cfg = TrainConfig.of(**TRAIN)
    lines: list[str] = []
    result = train_drafter(world["shards"], world["vocab"], world["target_dir"], out, cfg, log=lines.append)
    return {"out": out, "eval": result, "lines": lines}


def test_training_is_deterministic_on_cpu(world, trained, tmp_path):
    again = train_drafter(
        world["shards"], world["vocab"], world["target_dir"], tmp_path, TrainConfig.of(**TRAIN), log=lambda _: None
    )
    assert again["acceptance_per_position"] == trained["eval"]["acceptance_per_position"]
    a = (trained["out"] / "model.safetensors").read_bytes()
    assert a == (tmp_path / "model.safetensors").read_bytes()


def test_training_reduces_loss_and_raises_acceptance(trained):
    ev, out = trained["eval"], trained["out"]
    assert ev["heldout_loss"] < 0.7 * ev["untrained"]["heldout_loss"]
    assert ev["simulated_acceptance_length"] > ev["untrained"]["simulated_acceptance_length"] + 0.3
    assert len(ev["acceptance_per_position"]) == 3
    assert all(a >= b for a, b in zip(ev["acceptance_per_position"], ev["acceptance_per_position"][1:]))
    train_losses = [
        e["loss"] for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if e["event"] == "train"
    ]
    assert train_losses[-1] < 0.7 * train_losses[0]
    on_disk = json.loads((out / "eval.json").read_text())
    assert on_disk["simulated_acceptance_length"] == ev["simulated_acceptance_length"]
    assert on_disk["tokens_trained"] > 0 and on_disk["tokens_per_s"] > 0


# ---------------------------------------------------------------------------------------------------------
# (3) export matches what SGLang loads

# What SGLang expects, read from sgl-project/sglang python/sglang/srt/models/llama_eagle3.py at commit
# 03d5a7771f6082e7737a5f19cae7d1e863087013 (with models/llama.py at 00239548 for LlamaAttention/LlamaMLP):
#   checkpoint name -> (shape in symbols, dtype). V target vocab, Vd draft vocab, H hidden, I intermediate,
#   h/kv heads, d head_dim. fc is Linear(3 * target_hidden, hidden); q/k/v read 2H (qkv_proj override).
# embed_tokens is not exported: SGLang's EAGLE worker replaces it with the target's (set_embed).
SGLANG_EAGLE3_TENSORS = {
    "fc.weight": (("H", "3H"), "float"),
    "midlayer.input_layernorm.weight": (("H",), "float"),
    "midlayer.hidden_norm.weight": (("H",), "float"),
    "midlayer.self_attn.q_proj.weight": (("h*d", "2H"), "float"),
    "midlayer.self_attn.k_proj.weight": (("kv*d", "2H"), "float"),
    "midlayer.self_attn.v_proj.weight": (("kv*d", "2H"), "float"),
    "midlayer.self_attn.o_proj.weight": (("H", "h*d"), "float"),
    "midlayer.post_attention_layernorm.weight": (("H",), "float"),
    "midlayer.mlp.gate_proj.weight": (("I", "H"), "float"),
    "midlayer.mlp.up_proj.weight": (("I", "H"), "float"),
    "midlayer.mlp.down_proj.weight": (("H", "I"), "float"),
    "norm.weight": (("H",), "float"),
    "lm_head.weight": (("Vd", "H"), "float"),
    "d2t": (("Vd",), torch.int64),  # load_weights: hot_token_id = d2t + arange
    "t2d": (("V",), torch.bool),  # load_weights: skipped
}
# LlamaForCausalLMEagle3's own parameters; load_weights maps q/k/v -> qkv_proj and gate/up -> gate_up_proj,
# then looks a name up as-is or with a "model." prefix.
SGLANG_PARAMS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight",
    "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.post_attention_layernorm.weight",
    "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
}
SGLANG_STACKED = [
    (".q_proj", ".qkv_proj"),
    (".k_proj", ".qkv_proj"),
    (".v_proj", ".qkv_proj"),
    (".gate_proj", ".gate_up_proj"),
    (".up_proj", ".gate_up_proj"),
]


def _sglang_param_for(name: str) -> str | None:
    if "d2t" in name or "t2d" in name:
        return None
    for shard, stacked in SGLANG_STACKED:
        if shard in name:
            name = name.replace(shard, stacked)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def test_export_matches_sglang_and_reloads_identically(world, trained, tmp_path):
    out = trained["out"]
    c = TARGET
    sym = {
        "V": c["vocab_size"],
        "Vd": DRAFT_VOCAB,
        "H": c["hidden_size"],
        "3H": 3 * c["hidden_size"],
        "2H": 2 * c["hidden_size"],
        "I": c["intermediate_size"],
        "h*d": c["num_attention_heads"] * c["head_dim"],
        "kv*d": c["num_key_value_heads"] * c["head_dim"],
    }
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(SGLANG_EAGLE3_TENSORS)
        for name, (shape, dtype) in SGLANG_EAGLE3_TENSORS.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == tuple(sym[s] for s in shape), name
            assert t.dtype == (torch.bfloat16 if dtype == "float" else dtype), name
        assert torch.equal(f.get_tensor("d2t"), world["d2t"]) and torch.equal(f.get_tensor("t2d"), world["t2d"])
    # every parameter but the embeddings, which the target provides
    assert {_sglang_param_for(n) for n in names} - {None} == SGLANG_PARAMS - {"model.embed_tokens.weight"}

    cfg = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "vocab_size": c["vocab_size"],
        "draft_vocab_size": DRAFT_VOCAB,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True},
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg["aerie"]["format"] == "aerie.drafter/2" and cfg["aerie"]["tokens_trained"] > 0
    # no wall-clock figure in the export: two runs of the same training export identical bytes
    assert not any("second" in k or "per_s" in k for k in cfg["aerie"]), cfg["aerie"]
    hf = AutoConfig.from_pretrained(out)  # transformers reads it as a LlamaConfig with the extra fields
    assert isinstance(hf, LlamaConfig) and hf.draft_vocab_size == DRAFT_VOCAB and hf.head_dim == c["head_dim"]
    assert (
        hf.rope_parameters["rope_theta"] == 10000.0
        and hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    )

    # reload (with the target's embeddings): an fp32 re-export round-trips bit-exactly
    embed = world["target"].get_input_embeddings().weight
    model = Eagle3Drafter.from_pretrained(out, embed_tokens=embed).eval()
    model.save_pretrained(tmp_path / "fp32", dtype=None)
    again = Eagle3Drafter.from_pretrained(tmp_path / "fp32", embed_tokens=embed).eval()
    aux, ids = _seq_inputs(world, 2)
    n = ids.shape[1] - 1
    with torch.no_grad():
        a = model(model.project_aux(aux[:, :n]), ids[:, 1:], torch.arange(n)[None])
        b = again(again.project_aux(aux[:, :n]), ids[:, 1:], torch.arange(n)[None])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(model.draft_to_target(torch.arange(DRAFT_VOCAB)), torch.nonzero(world["t2d"]).flatten())


def _sglang_style_forward(
    folder: Path, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
):
    """The drafter forward re-derived from llama_eagle3.py's structure, straight from the checkpoint tensors
    and the target's embeddings: stacked qkv / gate_up weights as SGLang's load_weights builds them, fused
    add+norm, neox RoPE."""
    cfg = json.loads((folder / "config.json").read_text())
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    eps = cfg["rms_norm_eps"]
    h, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    p = "midlayer."
    qkv_w = torch.cat(
        [sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"]]
    )
    gate_up_w = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
    embeds = embed.float()[ids]  # [T, H]: the target's, as SGLang's worker sets them
    hidden = aux @ sd["fc.weight"].T  # hidden_states.shape[-1] != embeds.shape[-1] -> fc
    residual = hidden
    x = torch.cat([rms(embeds, sd[p + "input_layernorm.weight"]), rms(hidden, sd[p + "hidden_norm.weight"])], -1)
    q, k, v = (x @ qkv_w.T).split([h * d, kv * d, kv * d], dim=-1)
    inv = cfg["rope_theta"] ** (-torch.arange(0, d, 2).float() / d)
    ang = positions[:, None].float() * inv  # [T, d/2]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]

    def rope(t, n):
        t = t.view(-1, n, d)
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    q, k, v = rope(q, h), rope(k, kv), v.view(-1, kv, d)
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    T = len(ids)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, h * d) @ sd[p + "self_attn.o_proj.weight"].T
    residual = attn + residual  # post_attention_layernorm(hidden, residual): fused add, then norm
    gate, up = (rms(residual, sd[p + "post_attention_layernorm.weight"]) @ gate_up_w.T).chunk(2, -1)
    mlp = (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    aux_out = mlp + residual  # norm(hidden, residual): pre-norm sum is the hidden state for the next step
    logits = rms(aux_out, sd["norm.weight"]) @ sd["lm_head.weight"].T
    return logits, aux_out


def test_forward_follows_sglang_eagle3_structure(world, trained, tmp_path):
    embed = world["target"].get_input_embeddings().weight.detach()
    Eagle3Drafter.from_pretrained(trained["out"]).save_pretrained(tmp_path, dtype=None)  # fp32 copy
    model = Eagle3Drafter.from_pretrained(tmp_path, embed_tokens=embed).eval()
    aux, ids = _seq_inputs(world, 4)
    n = ids.shape[1] - 1
    with torch.no_grad():
        logits, hidden = model(model.project_aux(aux[:, :n]), ids[:, 1:], torch.arange(n)[None])
        ref_logits, ref_hidden = _sglang_style_forward(tmp_path, embed, aux[0, :n], ids[0, 1:], torch.arange(n))
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden[0], ref_hidden, atol=1e-4, rtol=1e-4)
