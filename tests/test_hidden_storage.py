"""Hidden-shard storage (aerie.hidden/2): the compact layout against the full one, layer-id refusals, the
capture backend dispatch and the disk preview.

The target is a tiny random Llama (hidden 256, so the compact layout's fixed per-token cost is small next to
the states, as it is for real targets) whose own greedy outputs are the data.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.drafter.config import TrainConfig
from aerie.drafter.data import load_batch, make_windows
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.eagle3.ttt import TargetHead
from aerie.formats.hidden import HIDDEN_FORMAT, HiddenShard, dequantize_aux, open_hidden_shards, quantize_aux
from aerie.formats.tokens import TOKENS_FORMAT
from aerie.formats.vocab import load_draft_vocab
from aerie.hidden.backends import HFCapture
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard
from aerie.preview.disk import bytes_per_token, disk_preview, specforge_bytes_per_token
from aerie.tools.artifacts import load_packed, save_packed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = dict(
    vocab_size=300,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    initializer_range=0.05,
)
AUX = [1, 2, 3]
NUM_SEQS, PROMPT_LEN, NEW_TOKENS = 48, 8, 24
TOPK = 16
TRAIN = dict(
    ttt_steps=2,
    epochs=8,
    learning_rate=3e-3,
    warmup_ratio=0.1,
    batch_size=8,
    max_seq_len=64,
    eval_fraction=0.2,
    seed=0,
    threads=1,
    log_every=100,
    checkpoint_every=0,
)


def _capture(world: dict, out: Path, **kw) -> dict:
    args = dict(
        aux_layer_ids=AUX,
        layout="compact",
        target_topk=TOPK,
        batch_tokens=512,
        threads=1,
        min_next_token_agreement=0.99,
    )
    log = kw.pop("log", lambda _: None)
    return capture_shard(world["tokens"], out, str(world["target_dir"]), CaptureSettings(**{**args, **kw}), log=log)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hidden_storage")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET)).eval()
    with torch.no_grad():  # a peaked next-token distribution, like a trained LM's
        target.lm_head.weight.mul_(8.0)
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    ids = torch.randint(3, TARGET["vocab_size"], (NUM_SEQS, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    n = ids.shape[1]
    mask = torch.zeros(n, dtype=torch.uint8)
    mask[PROMPT_LEN:] = 1
    tokens = root / "tokens.safetensors"
    save_packed(
        tokens,
        {
            "input_ids": ids.flatten().to(torch.int32),
            "loss_mask": mask.repeat(NUM_SEQS),
            "seq_offsets": torch.arange(NUM_SEQS + 1, dtype=torch.int64) * n,
        },
        {
            "format": TOKENS_FORMAT,
            "sample_ids": [f"toy/{i}" for i in range(NUM_SEQS)],
            # no chat template here: no generation prompt, and every sequence is cut at NEW_TOKENS
            "generation_prompt_ids": [],
            "stop_ids": [],
            "cut_sequences": list(range(NUM_SEQS)),
        },
    )
    world = {"root": root, "target": target, "target_dir": target_dir, "tokens": tokens, "ids": ids}
    world["compact"], world["full"], world["full32"] = (
        root / "compact.safetensors",
        root / "full.safetensors",
        root / "full32.safetensors",
    )
    world["compact_summary"] = _capture(world, world["compact"])
    _capture(world, world["full"], layout="full")
    _capture(world, world["full32"], layout="full", storage_dtype="float32")

    counts = torch.bincount(ids[:, PROMPT_LEN:].flatten(), minlength=TARGET["vocab_size"])
    draft_ids = torch.sort(torch.argsort(counts, descending=True, stable=True)[:128]).values
    t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    world["vocab"] = root / "draft_vocab.safetensors"
    save_file(
        {"d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d},
        str(world["vocab"]),
        metadata={"format": "aerie.draft-vocab/1"},
    )
    return world


def _rewrite_meta(src: Path, dst: Path, **changes) -> Path:
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update({k: json.dumps(v) for k, v in changes.items()})
    save_file(tensors, str(dst), metadata=meta)
    return dst


# ---------------------------------------------------------------------------------------------------------
# the compact layout keeps what training needs


def test_compact_round_trip(world):
    c, meta = load_packed(world["compact"], HIDDEN_FORMAT)
    f, fmeta = load_packed(world["full32"], HIDDEN_FORMAT)
    assert (meta["layout"], fmeta["layout"]) == ("compact", "full")
    assert meta["aux_layer_ids"] == fmeta["aux_layer_ids"] == AUX and meta["num_hidden_layers"] == 5
    assert meta["next_token_agreement"] == 1.0 and meta["target_topk"] == TOPK and 0 < meta["target_topk_mass"] <= 1
    assert c["aux_hidden_states"].dtype == torch.float8_e4m3fn and c["aux_scales"].dtype == torch.float32
    assert "final_hidden_states" not in c and torch.equal(c["input_ids"], f["input_ids"])

    # fp8 e4m3 (3 mantissa bits): every value within 1/16 of itself, plus the subnormal step near zero
    aux = f["aux_hidden_states"]  # the fp32 originals
    deq = dequantize_aux(c["aux_hidden_states"], c["aux_scales"])
    scale = c["aux_scales"].repeat_interleave(TARGET["hidden_size"], dim=1)
    assert ((deq - aux).abs() <= aux.abs() / 16 + scale * 2**-9).all()
    rel = ((deq - aux).norm(dim=-1) / aux.norm(dim=-1)).mean()
    assert rel < 0.04, rel
    q, s = quantize_aux(aux, len(AUX))  # deterministic: the stored bytes are exactly the codec's output
    assert torch.equal(q.view(torch.uint8), c["aux_hidden_states"].view(torch.uint8)) and torch.equal(
        s, c["aux_scales"]
    )

    # top-k = a direct lm_head computation on the full-precision final states
    logits = f["final_hidden_states"] @ world["target"].lm_head.weight.detach().T
    ref = torch.log_softmax(logits, -1).topk(TOPK, dim=-1)
    assert torch.equal(c["target_topk_ids"].long(), ref.indices)
    assert c["target_topk_logprobs"].dtype == torch.float16
    torch.testing.assert_close(c["target_topk_logprobs"].float(), ref.values, atol=1e-2, rtol=1e-3)
    assert torch.equal(c["target_topk_ids"][:, 0].long(), logits.argmax(-1))


def test_compact_bytes_per_token_at_most_half_of_specforge(world):
    H, tokens = TARGET["hidden_size"], int(world["ids"].numel())
    compact, full = world["compact"].stat().st_size / tokens, world["full"].stat().st_size / tokens
    specforge = specforge_bytes_per_token(H)  # 3 aux layers + final in bf16 = 8H
    assert full >= specforge and compact <= 0.5 * specforge, (compact, full, specforge)
    # the disk preview's formula is what the files hold (plus the safetensors header)
    assert (
        bytes_per_token(H, 3, "bfloat16", "compact", TOPK)
        <= compact
        < bytes_per_token(H, 3, "bfloat16", "compact", TOPK) + 8
    )
    assert bytes_per_token(H, 3, "bfloat16", "full") <= full < bytes_per_token(H, 3, "bfloat16", "full") + 8
    assert world["compact_summary"]["bytes"] == world["compact"].stat().st_size
    # Kimi K2.5 (hidden 7168): 0.38x
    assert bytes_per_token(7168, 3, layout="compact", target_topk=32) / specforge_bytes_per_token(7168) < 0.4


# ---------------------------------------------------------------------------------------------------------
# training reads both layouts


def test_batches_of_both_layouts_give_the_same_targets(world):
    vocab = load_draft_vocab(world["vocab"])
    lm_head = world["target"].lm_head.weight.detach()
    head = TargetHead(full=lm_head, draft=lm_head[vocab.target_ids], t2d=vocab.t2d)
    batches = {}
    for name in ("compact", "full32"):
        shard = HiddenShard(world[name])
        windows = [w for seq in range(4) for w in make_windows(0, shard, seq, 64, 2 + 1)]
        batches[name] = load_batch(windows, [shard], 2 + 1, torch.device("cpu"), torch.float32)
    c, f = batches["compact"], batches["full32"]
    assert f.topk_ids is None and c.final is None and torch.equal(c.ids, f.ids) and torch.equal(c.have, f.have)
    torch.testing.assert_close(c.aux, f.aux, atol=1e-4, rtol=1 / 16 + 1e-3)  # (atol: values near zero)
    qc, gc, hc = head.targets(c)
    qf, gf, hf = head.targets(f)
    have = c.have
    assert torch.equal(gc[have], gf[have]) and bool(hf[have].all())
    # the top-k soft targets are the full ones renormalised over the kept entries: same ranking where it counts
    rows = have & hc & vocab.t2d[gc]
    assert rows.float().mean() > 0.5
    assert torch.equal(qc[rows].argmax(-1), qf[rows].argmax(-1))
    assert torch.allclose(qc[hc & have].sum(-1), torch.ones(1), atol=1e-5) and not qc[~hc].any()


def test_training_reads_both_layouts(world, tmp_path):
    results = {}
    for name in ("compact", "full"):
        results[name] = train_drafter(
            [world[name]],
            world["vocab"],
            world["target_dir"],
            tmp_path / name,
            TrainConfig.of(**TRAIN),
            log=lambda _: None,
            layer_ids=AUX,
        )
    for r in results.values():
        assert r["simulated_acceptance_length"] > r["untrained"]["simulated_acceptance_length"]
    gap = abs(results["compact"]["simulated_acceptance_length"] / results["full"]["simulated_acceptance_length"] - 1)
    assert gap < 0.1, results  # (the bench measures this on the demo data: bench/hidden_storage.py)
    with pytest.raises(ValueError, match="disagree on their layout"):
        open_hidden_shards([world["compact"], world["full"]])


def test_compact_training_resumes_exactly(world, tmp_path):
    cfg = TrainConfig.of(**{**TRAIN, "epochs": 2, "checkpoint_every": 2})
    straight = train_drafter(
        [world["compact"]],
        world["vocab"],
        world["target_dir"],
        tmp_path / "a",
        cfg,
        log=lambda _: None,
        layer_ids=AUX,
    )

    def kill(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            [world["compact"]],
            world["vocab"],
            world["target_dir"],
            tmp_path / "b",
            cfg,
            log=lambda _: None,
            on_step=kill,
            layer_ids=AUX,
        )
    lines: list[str] = []
    resumed = train_drafter(
        [world["compact"]],
        world["vocab"],
        world["target_dir"],
        tmp_path / "b",
        cfg,
        log=lines.append,
        layer_ids=AUX,
    )
    assert any("resuming from" in x for x in lines)
    assert resumed["acceptance_per_position"] == straight["acceptance_per_position"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    # the same data in the other layout is other data: its state is refused
    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            [world["compact"]],
            world["vocab"],
            world["target_dir"],
            tmp_path / "c",
            cfg,
            log=lambda _: None,
            on_step=kill,
            layer_ids=AUX,
        )
    with pytest.raises(ValueError, match="hidden_shards differ"):
        train_drafter(
            [world["full"]],
            world["vocab"],
            world["target_dir"],
            tmp_path / "c",
            cfg,
            log=lambda _: None,
            layer_ids=AUX,
        )


# ---------------------------------------------------------------------------------------------------------
# layer ids: shards, configuration and export must agree


def test_shards_of_other_layers_or_depth_are_refused(world, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"compact\.safetensors was captured at layers \[1, 2, 3\].*the drafter reads "
        r"layers \[0, 2, 3\].*recapture",
    ):
        train_drafter(
            [world["compact"]],
            world["vocab"],
            world["target_dir"],
            tmp_path / "a",
            TrainConfig.of(**TRAIN),
            log=lambda _: None,
            layer_ids=[0, 2, 3],
        )
    deeper = _rewrite_meta(world["compact"], tmp_path / "deeper.safetensors", num_hidden_layers=61)
    with pytest.raises(
        ValueError,
        match=r"deeper\.safetensors was captured at layers \[1, 2, 3\] of a 61-layer "
        r"target.*\[1, 2, 3\] of the 5-layer target",
    ):
        train_drafter(
            [deeper],
            world["vocab"],
            world["target_dir"],
            tmp_path / "b",
            TrainConfig.of(**TRAIN),
            log=lambda _: None,
            layer_ids=AUX,
        )


def test_export_naming_other_layers_is_refused(world, tmp_path, monkeypatch):
    import aerie.drafter_kinds.eagle3.model as model

    real = model.DrafterConfig.to_hf_config

    def wrong_ids(self, *args, **kwargs):
        cfg = real(self, *args, **kwargs)
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
        return cfg

    monkeypatch.setattr(model.DrafterConfig, "to_hf_config", wrong_ids)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is \[0, 1, 2\].*aux layers \[1, 2, 3\]"):
        train_drafter(
            [world["compact"]],
            world["vocab"],
            world["target_dir"],
            tmp_path / "out",
            TrainConfig.of(**{**TRAIN, "epochs": 1}),
            log=lambda _: None,
            layer_ids=AUX,
        )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# capture backends


def test_sglang_backend_dispatch(world, tmp_path, monkeypatch):
    """backend sglang: SGLangCapture(target_path, layer_ids, dtype=..., **hidden.sglang) does the forwards, lm_head
    comes from the target's safetensors; the shard equals the hf backend's."""
    made = {}

    class FakeSGLangCapture:  # what aerie.hidden.sglang provides on a GPU host, played by transformers here
        def __init__(self, target_path, layer_ids, *, dtype, before_start, **kwargs):
            made.update(target_path=target_path, layer_ids=layer_ids, dtype=dtype, kwargs=kwargs)
            before_start()  # where the lm_head copy is placed: after the checks, before the workers start
            self._hf = HFCapture(target_path, layer_ids, device="cpu", dtype="float32")
            self.num_hidden_layers, self.hidden_size, self.vocab_size = 5, 256, 300

        def capture(self, seqs):
            return self._hf.capture(seqs)

        def close(self):
            made["closed"] = True

    monkeypatch.setattr("aerie.hidden.backends.SGLangCapture", FakeSGLangCapture)
    out = tmp_path / "sglang.safetensors"
    _capture(world, out, backend="sglang", backend_options={"tp_size": 1}, dtype="float32", device="cpu")
    assert made == {
        "target_path": str(world["target_dir"]),
        "layer_ids": AUX,
        "dtype": "float32",
        "kwargs": {"tp_size": 1},
        "closed": True,
    }
    a, meta = load_packed(out, HIDDEN_FORMAT)
    b, _ = load_packed(world["compact"], HIDDEN_FORMAT)
    assert meta["backend"] == "sglang" and a.keys() == b.keys()
    for k in a:
        assert torch.equal(
            a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
            b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k],
        ), k


def test_hf_backend_captures_a_kimi_shaped_wrapper_loaded_with_trust_remote_code(tmp_path):
    """Kimi K2.5 loads through its own code as KimiK25ForConditionalGeneration, whose decoder layers live at
    language_model.model.layers: the hf backend loads it with target.trust_remote_code and hooks those layers,
    and the states equal the wrapped DeepseekV3's own output_hidden_states."""
    import shutil

    from transformers import AutoModelForCausalLM

    from aerie.target_model.capture import base_decoder, decoder_layers
    from aerie.targets.rehearsal import remote_code
    from aerie.targets.rehearsal.build import REMOTE_MODEL_FILES, build_model
    from aerie.targets.rehearsal.config import RehearsalTargetConfig

    cfg = RehearsalTargetConfig(
        hidden_size=32,
        num_hidden_layers=5,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        vision_hidden_size=8,
    )
    model = build_model(cfg, live_ids=range(600)).eval()
    assert decoder_layers(model) is model.language_model.model.layers
    target = tmp_path / "kimi-shaped"
    model.save_pretrained(target)
    for name in REMOTE_MODEL_FILES:
        shutil.copyfile(Path(remote_code.__file__).parent / name, target / name)
    ids = torch.randint(0, 600, (3, 12), generator=torch.Generator().manual_seed(0))
    tokens = tmp_path / "tokens.safetensors"
    mask = torch.tensor([0] * 6 + [1] * 6, dtype=torch.uint8).repeat(3)
    save_packed(
        tokens,
        {
            "input_ids": ids.flatten().to(torch.int32),
            "loss_mask": mask,
            "seq_offsets": torch.arange(4, dtype=torch.int64) * 12,
        },
        {
            "format": TOKENS_FORMAT,
            "sample_ids": ["k/0", "k/1", "k/2"],
            "generation_prompt_ids": [],
            "stop_ids": [],
            "cut_sequences": [0, 1, 2],
        },
    )
    with pytest.raises(ValueError, match="trust_remote_code"):  # custom code is never run unless asked for
        capture_shard(
            tokens,
            tmp_path / "no.safetensors",
            str(target),
            CaptureSettings(
                aux_layer_ids=[1, 2, 3],
                layout="full",
                storage_dtype="float32",
                device="cpu",
                dtype="float32",
                threads=1,
            ),
            log=lambda _: None,
        )
    out = tmp_path / "hidden.safetensors"
    capture_shard(
        tokens,
        out,
        str(target),
        CaptureSettings(
            aux_layer_ids=[1, 2, 3],
            layout="full",
            storage_dtype="float32",
            device="cpu",
            dtype="float32",
            trust_remote_code=True,
            threads=1,
        ),
        log=lambda _: None,
    )
    t, meta = load_packed(out, HIDDEN_FORMAT)
    assert meta["num_hidden_layers"] == 5 and meta["aux_layer_ids"] == [1, 2, 3]
    loaded = AutoModelForCausalLM.from_pretrained(str(target), trust_remote_code=True).eval()
    assert type(loaded).__name__ == "KimiK25ForConditionalGeneration"
    with torch.no_grad():
        ref = base_decoder(loaded)(input_ids=ids, output_hidden_states=True).hidden_states
    aux = t["aux_hidden_states"].reshape(3, 12, -1)
    torch.testing.assert_close(aux, torch.cat([ref[i + 1] for i in (1, 2, 3)], -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t["final_hidden_states"].reshape(3, 12, -1), ref[-1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# disk preview


def test_disk_preview_reflects_layout(world, tmp_path):
    plan = types.SimpleNamespace(shard_names=["00000"], shard_range=lambda i: (0, 100))
    lines = {}
    for layout in ("compact", "full"):
        config = {  # as the Snakefile passes it: schema defaults filled in
            "target": {"path": str(world["target_dir"]), "device": "cpu", "dtype": "float32"},
            "hidden": {
                "aux_layer_ids": AUX,
                "layout": layout,
                "target_topk": 32,
                "storage_dtype": "bfloat16",
                "backend": "hf",
                "batch_tokens": 8192,
            },
        }
        lines[layout] = disk_preview(config, {"d": plan}, tmp_path, {"d": 10.0})
    assert (
        "x 977 bytes/token (compact: 3 aux layers x 256 x float8 + top-32 target tokens, 0.48x SpecForge's 8H)"
        in lines["compact"]
    )
    assert "x 2,053 bytes/token (full: 3 aux + final layer x 256 x bfloat16)" in lines["full"]
