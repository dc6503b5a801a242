"""Planted capture failures stop the hidden stage with the message that names them.

The seed project's first drafter had zero acceptance because hidden-state capture was silently off; an
off-by-one layer costs acceptance without any error. Each failure is planted into a real capture of a tiny
Llama target (the backend or the hooks are swapped for broken ones) and must fail the shard.
"""

from __future__ import annotations

import pytest
import torch
from tiny_world import save_random_llama
from transformers import LlamaForCausalLM

from aerie.formats.tokens import TOKENS_FORMAT
from aerie.hidden import backends
from aerie.hidden.checks import CaptureChecks, HiddenStateError
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard
from aerie.target_model.capture import AuxHiddenCapture
from aerie.tools.artifacts import save_packed

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("planted")
    model = LlamaForCausalLM.from_pretrained(save_random_llama(root / "target"))
    ids = torch.randint(3, 200, (6, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(12):  # the target's own greedy continuation: next-token agreement 1.0
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    mask = torch.zeros(ids.shape[1], dtype=torch.uint8)
    mask[8:] = 1
    save_packed(
        root / "tokens.safetensors",
        {
            "input_ids": ids.flatten().to(torch.int32),
            "loss_mask": mask.repeat(len(ids)),
            "seq_offsets": torch.arange(len(ids) + 1, dtype=torch.int64) * ids.shape[1],
        },
        {
            "format": TOKENS_FORMAT,
            "sample_ids": [f"p/{i}" for i in range(len(ids))],
            "generation_prompt_ids": [],
            "stop_ids": [],
            "cut_sequences": list(range(len(ids))),
        },
    )
    return {"root": root, "target": str(root / "target"), "tokens": root / "tokens.safetensors"}


def capture(world: dict, name: str) -> dict:
    return capture_shard(
        world["tokens"],
        world["root"] / f"{name}.safetensors",
        world["target"],
        CaptureSettings(aux_layer_ids=AUX, batch_tokens=256, threads=1, min_next_token_agreement=0.995),
        log=lambda _: None,
    )


def test_healthy_capture_passes(world) -> None:
    summary = capture(world, "ok")
    assert summary["next_token_agreement"] == 1.0 and summary["aux_layer_ids"] == AUX


def test_capture_silently_off_fails(world, monkeypatch) -> None:
    real = backends.open_backend

    class CaptureOff:
        """A server with aux capture off: it answers, with zeros where the aux states should be."""

        def __init__(self, inner):
            self.inner = inner
            self.num_hidden_layers, self.hidden_size, self.vocab_size = (
                inner.num_hidden_layers,
                inner.hidden_size,
                inner.vocab_size,
            )

        def capture(self, seqs):
            return [(torch.zeros_like(aux), final) for aux, final in self.inner.capture(seqs)]

        def close(self):
            self.inner.close()

    def broken(*args, **kwargs):
        cap, head = real(*args, **kwargs)
        return CaptureOff(cap), head

    monkeypatch.setattr(backends, "open_backend", broken)
    with pytest.raises(HiddenStateError, match=r"aux layer 1 is all zeros \(capture silently off\?\)"):
        capture(world, "off")
    assert not (world["root"] / "off.safetensors").exists()


class Planted:
    """A backend whose aux states are altered by ``plant(aux)`` after a real capture."""

    def __init__(self, inner, plant):
        self.inner, self.plant = inner, plant
        self.num_hidden_layers, self.hidden_size = inner.num_hidden_layers, inner.hidden_size
        self.vocab_size = inner.vocab_size

    def capture(self, seqs):
        return [(self.plant(aux.clone()), final) for aux, final in self.inner.capture(seqs)]

    def close(self):
        self.inner.close()


def _nan_at_one_position(aux: torch.Tensor) -> torch.Tensor:
    aux[5, 2 * 64 + 7] = float("nan")  # aux layer 4 (the third), one channel of one token
    return aux


def _inf_at_one_position(aux: torch.Tensor) -> torch.Tensor:
    aux[0, 2 * 64] = float("inf")
    return aux


def _minus_inf_at_one_position(aux: torch.Tensor) -> torch.Tensor:
    aux[7, 2 * 64 + 63] = -float("inf")
    return aux


def _whole_layer_nan(aux: torch.Tensor) -> torch.Tensor:
    # A layer that is NaN everywhere: with comparisons alone it would pass as non-zero, varying and unlike the
    # others (every comparison with NaN is false).
    aux[:, 2 * 64 :] = float("nan")
    return aux


@pytest.mark.parametrize(
    "plant", [_nan_at_one_position, _inf_at_one_position, _minus_inf_at_one_position, _whole_layer_nan]
)
def test_nan_or_inf_in_an_aux_layer_fails(world, monkeypatch, plant) -> None:
    real = backends.open_backend

    def broken(*args, **kwargs):
        cap, head = real(*args, **kwargs)
        return Planted(cap, plant), head

    monkeypatch.setattr(backends, "open_backend", broken)
    with pytest.raises(HiddenStateError, match=r"aux_hidden_states of aux layer 4 contain NaN or inf"):
        capture(world, f"nan-{plant.__name__}")
    assert not (world["root"] / f"nan-{plant.__name__}.safetensors").exists()


def test_nan_never_passes_the_layer_checks() -> None:
    """The zero / constant / identical checks refuse a NaN layer on their own, should NaN ever reach them."""
    checks = CaptureChecks([1, 2], 4, "s")
    checks.absmax = torch.tensor([float("nan"), 1.0])
    checks.varies[:] = True
    checks.identical[:] = False
    checks.rows = 3
    with pytest.raises(HiddenStateError, match="aux layer 1 is all zeros"):
        checks.finish()


def test_off_by_one_hooks_fail_the_convention_check(world, monkeypatch) -> None:
    class OneLate(AuxHiddenCapture):
        """Hooks registered one layer too deep: id i records layer i+1's output."""

        def __enter__(self):
            for i in self.layer_ids:
                self._handles.append(self._layers[i + 1].register_forward_hook(self._hook(i)))
            return self

    monkeypatch.setattr(backends, "AuxHiddenCapture", OneLate)
    with pytest.raises(
        HiddenStateError,
        match=r"aux id 1 is not the output of decoder layer 1 .*equals the output "
        r"of layer 2.*off by one",
    ):
        capture(world, "late")


def test_a_layer_that_does_nothing_shows_as_identical_layers(world, tmp_path) -> None:
    # Layers 2 and 3 whose residual updates are zero: layer 3's output IS layer 1's output - what a capture
    # that keeps returning one buffer looks like.
    model = LlamaForCausalLM.from_pretrained(world["target"])
    with torch.no_grad():
        for i in (2, 3):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    model.save_pretrained(tmp_path / "dead")
    with pytest.raises(HiddenStateError, match="aux layers 1 and 3 are identical"):
        capture_shard(
            world["tokens"],
            tmp_path / "x.safetensors",
            str(tmp_path / "dead"),
            CaptureSettings(aux_layer_ids=AUX, threads=1),
            log=lambda _: None,
        )


def test_unservable_layer_ids_are_refused_before_any_work(world, tmp_path) -> None:
    with pytest.raises(ValueError, match="last decoder layer's output"):
        capture_shard(
            world["tokens"],
            tmp_path / "x.safetensors",
            world["target"],
            CaptureSettings(aux_layer_ids=[1, 3, 5], threads=1),
            log=lambda _: None,
        )


def test_deepseek_family_ids_must_start_with_one() -> None:
    from aerie.target_model.config import check_servable_aux_layer_ids

    # SGLang's DeepseekV2/V3 (Kimi K2.5) read ids not starting with 1 as layer inputs: served one layer early.
    with pytest.raises(ValueError, match=r"do not start with 1: SGLang's DeepseekV3ForCausalLM adds 1"):
        check_servable_aux_layer_ids([2, 30, 58], 61, ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"])
    assert check_servable_aux_layer_ids([1, 29, 57], 61, ["KimiK25ForConditionalGeneration"]) == [1, 29, 57]
    assert check_servable_aux_layer_ids([2, 30, 58], 61, ["LlamaForCausalLM"]) == [2, 30, 58]
