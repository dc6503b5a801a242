"""The DFlash draft's rotary embedding equals what SGLang 0.5.23 computes for the draft's rope settings.

Two references: a float64 transcription of SGLang's formulas written here (RotaryEmbedding._compute_inv_freq;
YaRNScalingRotaryEmbedding: yarn_find_correction_range, yarn_linear_ramp_mask, the mscale rule), and the numbers
SGLang's own code produced when executed from the wheel (tests/fixtures/sglang/dflash_weights.json: inverse
frequencies, amplitude and cos/sin cache rows of the Kimi drafter, the tiny export and five YaRN settings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from aerie.drafter_kinds.dflash.rotary import DFlashRotary, apply_rotary, rotary_amplitude, rotary_inv_freq
from aerie.drafter_kinds.dflash.shape import rope_scaling_of

RECORD = json.loads((Path(__file__).parent / "fixtures" / "sglang" / "dflash_weights.json").read_text())
KIMI_YARN = {
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def sglang_inv_freq_f64(dim: int, base: float, scaling: dict | None) -> list[float]:
    """SGLang's inverse frequencies, transcribed in float64 (python floats)."""
    extrap = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if not scaling:
        return extrap
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast", 32)), correction_dim(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = (1 - ramp) * scaling.get("extrapolation_factor", 1)
        out.append(extrap[i] / factor * (1 - keep) + extrap[i] * keep)
    return out


def sglang_amplitude_f64(scaling: dict | None) -> float:
    if not scaling:
        return 1.0

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    f = scaling["factor"]
    if scaling.get("mscale") is not None and scaling.get("mscale_all_dim") is not None:
        a = get_mscale(f, scaling["mscale"]) / get_mscale(f, scaling["mscale_all_dim"])
    else:
        a = get_mscale(f)
    return a * scaling.get("attn_factor", 1.0)


CASES = [
    (128, 50000.0, KIMI_YARN),
    (128, 50000.0, {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16}),
    (24, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "truncate": False}),
    (128, 1e6, None),
    (8, 10000.0, None),
]


@pytest.mark.parametrize(("dim", "base", "scaling"), CASES)
def test_inv_freq_and_amplitude_equal_the_float64_transcription(dim, base, scaling) -> None:
    ours = rotary_inv_freq(dim, base, scaling)
    assert ours.dtype == torch.float32 and ours.shape == (dim // 2,)
    ref = torch.tensor(sglang_inv_freq_f64(dim, base, scaling), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-6, atol=0)
    assert rotary_amplitude(scaling) == pytest.approx(sglang_amplitude_f64(scaling), rel=1e-15)


def test_kimi_amplitude_is_one_and_the_plain_yarn_rule_is_not() -> None:
    """z-lab's K2.5 settings (factor 64, mscale = mscale_all_dim = 1.0): SGLang's amplitude is exactly 1.0. Without
    both mscale keys SGLang takes 0.1 ln(64) + 1 = 1.4159 (also when only ``mscale`` is set: it is then ignored)."""
    assert rotary_amplitude(KIMI_YARN) == 1.0
    plain = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}
    assert rotary_amplitude(plain) == pytest.approx(1.4158883083359672, abs=1e-15)
    assert rotary_amplitude({**plain, "mscale": 0.707}) == rotary_amplitude(plain)
    assert rotary_amplitude({**plain, "mscale": 1.0, "mscale_all_dim": 0.5}) == pytest.approx(
        (1 + 0.1 * math.log(64)) / (1 + 0.05 * math.log(64))
    )


def _recorded_cases():
    cases = {f"rope_cases/{k}": (v, v["rope_scaling"], 128, 50000.0) for k, v in RECORD["rope_cases"].items()}
    for kind in ("kimi", "tiny", "folder_fixture"):
        rot = RECORD["kinds"][kind]["rotary"]
        args = rot["get_rope"]
        scaling = args["rope_scaling"]
        cases[f"kinds/{kind}"] = (rot, scaling, rot["rotary_dim"], float(args["base"]))
    return cases


@pytest.mark.parametrize("case", sorted(_recorded_cases()))
def test_equals_the_numbers_sglangs_own_code_produced(case) -> None:
    rec, scaling, dim, base = _recorded_cases()[case]
    ours = DFlashRotary(dim, base, rope_scaling_of(scaling))
    assert rec["is_neox_style"] is True
    assert ours.amplitude == pytest.approx(rec["amplitude"], rel=1e-15)
    torch.testing.assert_close(ours.inv_freq, torch.tensor(rec["inv_freq"], dtype=torch.float32), rtol=0, atol=0)
    rows = sorted(int(r) for r in rec["cos_sin_rows"])
    cos, sin = ours.cos_sin(torch.tensor([rows]))
    got = torch.cat([cos[0, 0], sin[0, 0]], dim=-1)  # SGLang's cache row: [cos | sin]
    want = torch.tensor([rec["cos_sin_rows"][str(r)] for r in rows], dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_kimi_record_is_yarn_with_amplitude_one() -> None:
    rot = RECORD["kinds"]["kimi"]["rotary"]
    assert rot["class"] == "YaRNScalingRotaryEmbedding" and rot["amplitude"] == 1.0
    assert RECORD["rope_cases"]["no_mscale_keys"]["amplitude"] == pytest.approx(1.4158883083359672)
    assert RECORD["kinds"]["tiny"]["rotary"]["class"] == "RotaryEmbedding"


def test_apply_rotary_is_the_neox_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 50, 4000], [7, 7, 8, 9, 100000]])
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    rot = DFlashRotary(16, 10000.0, scaling)
    cos, sin = rot.cos_sin(positions)
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.float64
    # the frequencies are checked above; the angles are an fp32 product as in SGLang's cache (at position 1e5 that
    # is ~1e-2 rad off float64), so the rotation is compared on the same angles
    angle = (positions.float()[:, None, :, None] * rot.inv_freq).double()
    amp = sglang_amplitude_f64(scaling)
    x1, x2 = x[..., :8], x[..., 8:]
    ref = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1) * amp
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    bf16 = apply_rotary(x.bfloat16(), cos, sin)
    assert bf16.dtype == torch.bfloat16


def test_scores_depend_on_relative_position_only() -> None:
    """With amplitude 1 a rotated q.k depends on the position difference (what lets packed rows restart)."""
    rot = DFlashRotary(32, 50000.0, KIMI_YARN)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 32, generator=g), torch.randn(1, 1, 1, 32, generator=g)

    def score(pq, pk):
        cq, sq = rot.cos_sin(torch.tensor([[pq]]))
        ck, sk = rot.cos_sin(torch.tensor([[pk]]))
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(1010, 1003), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-4)
