"""A CPU stand-in for SGLang's part of the capture (aerie.hidden.sglang.SGLang0523) with real tensor parallelism.

What it reproduces of SGLang 0.5.23 (read from its source), on CPU with gloo instead of NCCL:

- the model classes aerie's capture meets: ``models/llama.py`` (``set_eagle3_layers_to_capture``: the inputs of
  the ids + 1), ``models/deepseek_v2.py`` (+ 1 only when the first id is 1, else the ids' own inputs; no ids:
  ``[2, L//2, L-3]``) and ``models/kimi_k25.py`` (the K2.5 wrapper: a ``DeepseekV3ForCausalLM`` as
  ``language_model``, its ``model`` property aliasing it, ``set_eagle3_layers_to_capture`` forwarded to it);
- how the wrapper loads a checkpoint (``KimiK25ForConditionalGeneration.load_weights``): vision weights apart,
  the ``language_model.`` prefix stripped from the rest, which go into the DeepseekV3 language model;
- tensor parallelism as far as the hidden states go: each rank holds a column slice of the inputs of every
  row-parallel projection (attention ``o_proj``, MLP and shared-expert ``down_proj``) and the partial outputs are
  summed by an all-reduce across the ranks (``RowParallelLinear(reduce_results=True)``), so after each layer
  every rank holds the whole residual stream; the captured aux states are the residual stream entering the
  layers in ``layers_to_capture`` and the final state the post-norm output, every token of the batch end to end
  (``LogitsProcessorOutput.hidden_states`` / ``last_hidden_states`` under ``CaptureHiddenMode.FULL``);
- a forward needs every rank: a rank left out leaves the others blocked in their all-reduce.

What it does not: the column-parallel projections compute their full output on every rank (the split that
matters for what is captured is the reduction), routed experts are not sharded (transformers keeps them as fused
parameters; each rank computes them whole, which changes no sum), the vocab-parallel lm_head and its logits
gather are left out (aerie never reads SGLang's logits), and there are no KV pools, CUDA graphs or kernels.

Flavours for the failures aerie must catch: ``fake_skip_all_reduce`` (each rank keeps its partial sums: states
that are not replicated), ``fake_split_rows`` (each rank returns only its share of the token rows, as with data-
parallel attention).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from aerie.hidden.sglang.mapping import TESTED_SGLANG_VERSION, capture_layers_of
from aerie.target_model.config import text_config

ROW_PARALLEL = ("o_proj", "down_proj")


# ---- SGLang's model classes, as far as the capture sees them ---------------------------------------------------


class LlamaForCausalLM(nn.Module):
    """models/llama.py: ``model`` is the decoder stack; EAGLE-3 capture at the inputs of the ids + 1."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm  # the transformers causal LM doing the arithmetic
        self.lm.model.layers_to_capture = []

    @property
    def decoder(self) -> nn.Module:
        return self.lm.model

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        num_layers = self.lm.config.num_hidden_layers
        if layer_ids is None:
            self.decoder.layers_to_capture = [2, num_layers // 2, num_layers - 3]
        else:
            self.decoder.layers_to_capture = [v + 1 for v in layer_ids]


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """models/deepseek_v2.py (DeepseekV3ForCausalLM subclasses DeepseekV2ForCausalLM): + 1 only if ids[0] == 1."""

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        if layer_ids is None:
            num_layers = self.lm.config.num_hidden_layers
            self.decoder.layers_to_capture = [2, num_layers // 2, num_layers - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.decoder.layers_to_capture = [v + 1 for v in layer_ids]
        else:
            self.decoder.layers_to_capture = list(layer_ids)


class KimiK25ForConditionalGeneration(nn.Module):
    """models/kimi_k25.py: the DeepseekV3 language model as ``language_model``; ``model`` aliases it without
    registering it twice; EAGLE-3 capture forwarded to it. The vision tower is not built (never run for text)."""

    def __init__(self, language_model: DeepseekV3ForCausalLM) -> None:
        super().__init__()
        self.language_model = language_model

    @property
    def model(self) -> nn.Module:
        return self.language_model

    @property
    def decoder(self) -> nn.Module:
        return self.language_model.decoder

    @property
    def lm(self) -> nn.Module:
        return self.language_model.lm

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.language_model.set_eagle3_layers_to_capture(layer_ids)


# ---- tensor parallelism ----------------------------------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """This rank's input columns of ``linear``; the partial outputs summed over the ranks (SGLang's
    RowParallelLinear with reduce_results=True); the bias added once."""

    def __init__(self, linear: nn.Linear, rank: int, ranks: int, reduce: bool = True) -> None:
        super().__init__()
        cols = torch.arange(linear.in_features).tensor_split(ranks)[rank]
        self.lo, self.hi = int(cols[0]), int(cols[-1]) + 1
        self.weight = nn.Parameter(linear.weight.detach()[:, self.lo : self.hi].clone(), requires_grad=False)
        self.bias = linear.bias if rank == 0 else None
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x[..., self.lo : self.hi], self.weight, self.bias)
        if self.reduce and dist.is_initialized():
            dist.all_reduce(y)
        return y


def shard(lm: nn.Module, rank: int, ranks: int, reduce: bool = True) -> int:
    """Replace every row-parallel projection of ``lm`` by this rank's slice; returns how many."""
    found = [(name, m) for name, m in lm.named_modules() if name.rsplit(".", 1)[-1] in ROW_PARALLEL]
    for name, linear in found:
        parent, _, child = name.rpartition(".")
        setattr(lm.get_submodule(parent), child, RowParallelLinear(linear, rank, ranks, reduce))
    return len(found)


# ---- loading a checkpoint as SGLang does -------------------------------------------------------------------------


def load_like_sglang(target: Path) -> nn.Module:
    """The SGLang model class for ``target``'s architecture, with its weights loaded as that class does.

    The arithmetic is transformers' own model of the text config; the checkpoint's names for it are the wrapper's
    minus ``language_model.`` (written to a scratch folder so transformers converts the per-expert tensors into
    its fused ones, as SGLang's DeepseekV2 loader maps them into its MoE)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((target / "config.json").read_text())
    arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch != "KimiK25ForConditionalGeneration":
        lm = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        return (DeepseekV3ForCausalLM if "Deepseek" in arch else LlamaForCausalLM)(lm)
    language = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "vision_tower" in name or "mm_projector" in name:
                    continue  # loaded into the vision tower, inline (none here)
                language[name.replace("language_model.", "")] = f.get_tensor(name)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text(json.dumps(text_config(config)))
        save_file(language, str(Path(scratch) / "model.safetensors"), metadata={"format": "pt"})
        lm = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()
    return KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM(lm))


# ---- the backend protocol (SGLang0523's methods) -----------------------------------------------------------------


class SGLangTP:
    """Stands in for SGLang0523 in the capture's worker processes: the same methods, SGLang's TP on CPU."""

    @staticmethod
    def installed_version() -> str:
        return TESTED_SGLANG_VERSION

    @staticmethod
    def prepare(server_kwargs: dict) -> dict:
        # As PortArgs.init_new picks the ranks' NCCL port: a free port, here on loopback for gloo.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return {**server_kwargs, "dist_init": f"tcp://127.0.0.1:{port}"}

    @staticmethod
    def load(payload: dict, rank: int, gpu_id: int) -> Any:
        torch.set_num_threads(1)
        ranks = int(payload.get("tp_size", 1))
        if ranks > 1:
            dist.init_process_group("gloo", init_method=payload["dist_init"], rank=rank, world_size=ranks)
        model = load_like_sglang(Path(payload["model_path"]))
        sharded = shard(model.lm, rank, ranks, reduce=not payload.get("fake_skip_all_reduce")) if ranks > 1 else 0
        model.set_eagle3_layers_to_capture(payload["return_aux_hidden_state_layer_ids"])  # as ModelRunner does
        return SimpleNamespace(model=model, rank=rank, ranks=ranks, sharded=sharded, payload=payload)

    @staticmethod
    def runner_info(runner: Any) -> dict:
        cfg = runner.model.lm.config
        return {
            "layers_to_capture": capture_layers_of(runner.model),
            "model_class": type(runner.model).__name__,
            "max_tokens": 4096,
            "max_requests": 8,
            "context_len": int(cfg.max_position_embeddings),
            "chunk_tokens": None,
            "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "row_parallel_layers": runner.sharded,
        }

    @staticmethod
    @torch.no_grad()
    def extend(runner: Any, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = runner.model.decoder
        capture = list(decoder.layers_to_capture)
        aux, final = [], []
        for ids in seqs:
            seen: dict[int, torch.Tensor] = {}

            def keep(j: int, args: tuple, kwargs: dict, seen: dict = seen) -> None:
                seen[j] = kwargs.get("hidden_states", args[0] if args else None)  # the residual stream entering j

            hooks = [
                decoder.layers[j].register_forward_pre_hook(
                    lambda _m, args, kwargs, j=j, keep=keep: keep(j, args, kwargs), with_kwargs=True
                )
                for j in capture
                if j < len(decoder.layers)
            ]
            try:
                final.append(decoder(input_ids=torch.tensor([ids])).last_hidden_state[0])
            finally:
                for h in hooks:
                    h.remove()
            if len(seen) != len(capture):  # AuxHiddenStatePacker.finalize in 0.5.23
                raise RuntimeError(f"captured {len(seen)} of {len(capture)} aux hidden states")
            aux.append(torch.cat([seen[j][0] for j in capture], -1))
        aux_t, final_t = torch.cat(aux), torch.cat(final)
        if runner.payload.get("fake_split_rows") and runner.ranks > 1:
            rows = torch.arange(len(final_t)).tensor_split(runner.ranks)[runner.rank]
            aux_t, final_t = aux_t[rows], final_t[rows]
        return aux_t, final_t

    @staticmethod
    def release(runner: Any) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class WaitsForTheCopy(SGLangTP):
    """Refuses to load unless ``fake_marker`` exists: the parent writes it when it has placed its lm_head copy."""

    @staticmethod
    def load(payload: dict, rank: int, gpu_id: int) -> Any:
        if not Path(payload["fake_marker"]).exists():
            raise RuntimeError("SGLang started before the lm_head copy was placed")
        return SGLangTP.load(payload, rank, gpu_id)
