"""Hidden-state capture through SGLang (``hidden.backend: sglang``), for targets only SGLang can run.

Route (SGLang 0.5.23, pinned in envs/sglang.yaml). SGLang's serving Engine can return aux hidden states
(``--enable-return-aux-hidden-states``), but in that mode the response carries the aux states *instead of*
the final ones, and as Python lists (``tolist()`` of 3 x 7168 floats a token for Kimi) sent between its
processes, which would cost more than the forward itself.
So, like SpecForge's offline capture and SGLang's own ``sglang.benchmark.one_batch``, each tensor-parallel
rank runs a ``ModelRunner`` in a worker process and does one extend (prefill) forward per batch with
``CaptureHiddenMode.FULL``. The server arguments ``enable_return_aux_hidden_states=True``,
``speculative_algorithm="EAGLE3"`` and ``return_aux_hidden_state_layer_ids=<aerie ids>`` make SGLang
itself call the model's ``set_eagle3_layers_to_capture(ids)`` - the exact call it makes when it serves a
drafter whose ``eagle_config.eagle_aux_hidden_state_layer_ids`` are those ids - and keep the post-norm
final state of every token beside the aux states (``LogitsProcessorOutput.last_hidden_states``).
Rank 0 copies both into shared memory; the parent splits them per sequence.

Layer ids. aerie's id ``i`` is the output of 0-based decoder layer ``i`` (transformers'
``output_hidden_states[i + 1]``). SGLang captures the residual stream at the *input* of the layers in
``model.layers_to_capture``; ``set_eagle3_layers_to_capture`` sets that to ``[i + 1 for i in ids]`` for
most models (llama.py, qwen2.py, ...), which is the same tensor. DeepseekV2/V3 (and so Kimi K2.5) add the
1 only when the first id is 1 and otherwise capture the inputs of the ids themselves, one layer early.
After loading, the worker reads ``layers_to_capture`` back from the model and the capture refuses to run
unless it equals ``[i + 1 for i in ids]``: training data then matches both aerie's convention and what
SGLang feeds the drafter when it serves it. SGLang cannot capture the last layer's output (no layer
follows it), so id ``L - 1`` is refused up front.

Everything that touches SGLang internals is in :class:`SGLang0523`; the rest (id mapping, argument
building, batching, splitting and checking outputs, the worker protocol) is plain torch and is tested
without SGLang. ``python -m aerie.sglang_capture check ...`` compares against transformers on a GPU host.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import queue
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aerie.target.config import FIRST_ID_MUST_BE_ONE, check_servable_aux_layer_ids

TESTED_SGLANG_VERSION = "0.5.23"  # the version SGLang0523 was written against (envs/sglang.yaml)
ANY_VERSION_ENV = "AERIE_SGLANG_ANY_VERSION"  # set to 1 to try another SGLang version anyway

# Keys aerie sets itself: a user value would change what is captured or how.
MANAGED_KWARGS = frozenset({
    "model_path", "enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids",
    "speculative_algorithm", "speculative_draft_model_path", "enable_return_hidden_states",
    "return_hidden_states_mode",
})
# Settings the capture cannot support: hidden rows would be split across ranks or pipeline stages.
REFUSED_KWARGS = {"pp_size": 1, "dp_size": 1, "enable_dp_attention": False, "nnodes": 1}

# FIRST_ID_MUST_BE_ONE (aerie.target.config): DeepSeek-family models, whose ids must start with 1 in SGLang.


class SGLangUnavailableError(ImportError):
    """SGLang is not importable here (it lives in its own environment, envs/sglang.yaml)."""


class SGLangCaptureError(RuntimeError):
    """SGLang would capture something other than what aerie asked for, or a worker failed."""


# ---- layer-id convention --------------------------------------------------------------------------------

def sglang_capture_inputs(layer_ids: Sequence[int]) -> list[int]:
    """aerie aux ids (decoder-layer outputs) -> the layer indices whose *input* SGLang must capture.

    The output of layer ``i`` is the input of layer ``i + 1`` (the residual stream between them)."""
    return [int(i) + 1 for i in layer_ids]


def captured_output_ids(layers_to_capture: Sequence[int]) -> list[int]:
    """The inverse: what aerie calls the tensors SGLang captures at the inputs of ``layers_to_capture``."""
    return [int(j) - 1 for j in layers_to_capture]


def predicted_capture_inputs(architectures: Sequence[str], layer_ids: Sequence[int]) -> list[int]:
    """What sglang 0.5.23's set_eagle3_layers_to_capture will set for these ids (see FIRST_ID_MUST_BE_ONE)."""
    ids = [int(i) for i in layer_ids]
    if any(a in FIRST_ID_MUST_BE_ONE for a in architectures) and ids and ids[0] != 1:
        return ids
    return sglang_capture_inputs(ids)


def check_capture_mapping(layer_ids: Sequence[int], layers_to_capture: Sequence[int], model: str = "the target") -> None:
    """Refuse unless SGLang captures exactly the outputs of ``layer_ids`` (aerie's convention)."""
    expected = sglang_capture_inputs(layer_ids)
    got = [int(j) for j in layers_to_capture]
    if got == expected:
        return
    raise SGLangCaptureError(
        f"SGLang maps the aux layer ids {list(layer_ids)} of {model} to layer inputs {got}, i.e. decoder-layer "
        f"outputs {captured_output_ids(got)}, not {list(layer_ids)} (inputs {expected}). SGLang applies the same "
        f"mapping when it serves a drafter with these eagle_config ids, so a drafter trained on aerie's convention "
        f"would be served off by one. DeepseekV2/V3 and Kimi K2.5 in SGLang add 1 only when the first id is 1: "
        f"choose ids starting with 1 (SGLang's default [1, L//2-1, L-4] does).")


def capture_layers_of(model: nn.Module) -> list[int]:
    """The layer inputs a loaded SGLang model will capture (``layers_to_capture`` of its decoder stack).

    Raises when the model cannot capture EAGLE-3 states or captures nothing: never a silent empty capture."""
    if not callable(getattr(model, "set_eagle3_layers_to_capture", None)):
        raise SGLangCaptureError(
            f"{type(model).__name__} has no set_eagle3_layers_to_capture: this SGLang model cannot capture EAGLE-3 "
            f"aux hidden states (older Kimi K2.5 wrappers lack it; use an SGLang whose model class has it)")
    found = {name: list(m.layers_to_capture) for name, m in model.named_modules()
             if isinstance(getattr(m, "layers_to_capture", None), (list, tuple)) and len(m.layers_to_capture)}
    if not found:
        raise SGLangCaptureError(
            f"{type(model).__name__}: set_eagle3_layers_to_capture left every layers_to_capture empty: "
            f"SGLang would capture nothing")
    if len({tuple(v) for v in found.values()}) > 1:
        raise SGLangCaptureError(f"{type(model).__name__}: several decoder stacks capture different layers: {found}")
    return next(iter(found.values()))


# ---- target and SGLang arguments ------------------------------------------------------------------------

def target_dims(config: Mapping[str, Any]) -> dict[str, Any]:
    """num_hidden_layers, hidden_size, vocab_size (multimodal wrappers such as Kimi K2.5 nest them in
    ``text_config``) and the top-level architectures, from a config.json mapping."""
    text = config
    for key in ("text_config", "language_config", "llm_config"):
        nested = config.get(key)
        if isinstance(nested, Mapping) and "hidden_size" in nested:
            text = nested
            break
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)} (top level keys: {sorted(config)})")
    return {"num_hidden_layers": int(text["num_hidden_layers"]), "hidden_size": int(text["hidden_size"]),
            "vocab_size": int(text["vocab_size"]), "architectures": list(config.get("architectures") or [])}


def sglang_server_kwargs(target_path: str, layer_ids: Sequence[int], dtype: Any = "auto",
                         user_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """ServerArgs keyword arguments for the capture: aux capture on the target, no draft, no CUDA graphs.

    ``user_kwargs`` (tp_size, mem_fraction_static, trust_remote_code, context_length, ...) go on to SGLang;
    the keys aerie manages and settings that would split hidden rows across processes are refused."""
    user = dict(user_kwargs or {})
    clash = sorted(set(user) & MANAGED_KWARGS)
    if clash:
        raise ValueError(f"hidden.sglang: {clash} are set by aerie's SGLang capture and cannot be overridden")
    for key, allowed in REFUSED_KWARGS.items():
        if key in user and user[key] != allowed:
            raise ValueError(f"hidden.sglang: {key}={user[key]!r} is not supported by the capture (only {allowed!r}): "
                             f"use tp_size to spread the target over GPUs")
    tp = user.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"hidden.sglang: tp_size must be an integer >= 1, got {tp!r}")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return {
        "model_path": str(target_path),
        "dtype": str(dtype),
        # Capture-only mode: SGLang calls set_eagle3_layers_to_capture(ids) as when serving an EAGLE-3 drafter
        # with these eagle_config ids, loads no draft, and keeps the post-norm final state beside the aux ones.
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": [int(i) for i in layer_ids],
        # One eager prefill per batch: graphs would only pin memory, a radix cache would skip cached prefixes.
        "disable_cuda_graph": True,
        "disable_radix_cache": True,
        "skip_tokenizer_init": True,  # requests carry token ids; Kimi's tiktoken tokenizer is never needed
        "log_level": "warning",
        **user,
    }


def gpu_ids(server_kwargs: Mapping[str, Any]) -> list[int]:
    """The device index of each tensor-parallel rank (SGLang's base_gpu_id / gpu_id_step)."""
    tp = int(server_kwargs.get("tp_size", 1))
    base, step = int(server_kwargs.get("base_gpu_id", 0)), int(server_kwargs.get("gpu_id_step", 1))
    return [base + r * step for r in range(tp)]


# ---- batches and outputs --------------------------------------------------------------------------------

def check_sequences(seqs: Sequence[torch.Tensor], vocab_size: int) -> list[list[int]]:
    """1-D integer tensors of known token ids -> lists of ints (what SGLang's requests take)."""
    out = []
    for s, t in enumerate(seqs):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
            raise ValueError(f"sequence {s}: expected a 1-D integer tensor, got "
                             f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}")
        if not len(t):
            raise ValueError(f"sequence {s} is empty")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"sequence {s}: token ids span [{lo}, {hi}], outside the target's vocabulary "
                             f"[0, {vocab_size})")
        out.append(t.tolist())
    return out


def plan_forwards(lengths: Sequence[int], *, max_tokens: int, max_requests: int, context_len: int | None = None,
                  chunk_tokens: int | None = None) -> list[list[int]]:
    """Split a batch into forwards (lists of indices, in order) that fit SGLang's pools.

    ``max_tokens``/``max_requests``: the KV and request pools (a forward must fit whole). ``chunk_tokens``:
    SGLang's chunked_prefill_size, the prefill size its memory budget assumes; a longer sequence runs alone."""
    limit = max_tokens if not chunk_tokens or chunk_tokens < 0 else min(max_tokens, chunk_tokens)
    forwards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if context_len is not None and n > context_len:
            raise ValueError(f"sequence {i} has {n} tokens, more than the target's context length {context_len} in SGLang")
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens, more than SGLang's KV pool holds ({max_tokens}): "
                             f"raise mem_fraction_static or lower tokens.max_seq_len")
        if current and (used + n > limit or len(current) >= max_requests):
            forwards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        forwards.append(current)
    return forwards


def split_capture(aux: torch.Tensor | None, final: torch.Tensor | None, lengths: Sequence[int], num_aux: int,
                  hidden_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SGLang's flat outputs of one extend forward -> per-sequence (aux [T, A*H], final [T, H]).

    SGLang lays the batch's tokens end to end: aux [sum T, A*H] (layers concatenated in layer order),
    final [sum T, H]. Any other shape means the capture is not what was asked for, and says how."""
    total, width = sum(lengths), num_aux * hidden_size
    if aux is None:
        raise SGLangCaptureError("SGLang returned no hidden states: the forward did not run in FULL capture mode")
    if final is None:
        raise SGLangCaptureError("SGLang returned no final (post-norm) hidden states beside the aux ones: "
                                 "this SGLang keeps last_hidden_states only with --enable-return-aux-hidden-states")
    if aux.dim() != 2 or final.dim() != 2:
        raise SGLangCaptureError(f"SGLang returned aux {tuple(aux.shape)}, final {tuple(final.shape)}: "
                                 f"expected 2-D [tokens, width]")
    if aux.shape[0] != total or final.shape[0] != total:
        hint = (" (one row per sequence: the hidden states were pruned to the last token, capture mode LAST)"
                if aux.shape[0] == len(lengths) else "")
        raise SGLangCaptureError(f"SGLang returned {aux.shape[0]} aux and {final.shape[0]} final rows for a batch of "
                                 f"{total} tokens in {len(lengths)} sequences{hint}")
    if final.shape[1] != hidden_size:
        raise SGLangCaptureError(f"SGLang's final hidden states are {final.shape[1]} wide, "
                                 f"the target's hidden_size is {hidden_size}")
    if aux.shape[1] != width:
        if aux.shape[1] == hidden_size:
            hint = "one hidden state wide: aux capture is off and SGLang returned the final state in its place"
        elif aux.shape[1] % hidden_size == 0:
            hint = f"{aux.shape[1] // hidden_size} layers captured, {num_aux} asked for"
        else:
            hint = "not a multiple of hidden_size"
        raise SGLangCaptureError(f"SGLang's aux hidden states are {aux.shape[1]} wide, expected {num_aux} x {hidden_size} "
                                 f"= {width} ({hint})")
    return list(zip(aux.split(list(lengths)), final.split(list(lengths))))


# ---- the SGLang-version-specific part -------------------------------------------------------------------

class SGLang0523:
    """Everything that touches SGLang internals, as of sglang 0.5.23.

    Modelled on sglang/benchmark/one_batch.py (SGLang's own in-process runner: ``main``, ``load_model``,
    ``extend``) and srt/layers/logits_processor.py (``last_hidden_states`` under FULL capture). ``prepare``
    runs in the parent; the rest in each rank's worker process."""

    @staticmethod
    def installed_version() -> str:
        try:
            import sglang
        except ImportError as e:
            raise SGLangUnavailableError(
                f"hidden.backend sglang needs SGLang, which is not importable here ({e}). SGLang pins its own torch and "
                f"transformers: run the hidden rule in its environment, envs/sglang.yaml (`snakemake --sdm conda`), or "
                f"`conda env create -f envs/sglang.yaml` on the GPU host") from e
        return str(getattr(sglang, "__version__", "unknown"))

    @staticmethod
    def prepare(server_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Resolve the server arguments once and pick the ports; the result is pickled to every rank."""
        import signal

        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import PortArgs, ServerArgs

        load_plugins()  # as Engine does: plugins may hook ServerArgs
        server_args = ServerArgs(**server_kwargs)
        server_args.resolve_once()
        # NCCL and kernel environment variables, inherited by the workers. It also installs a SIGQUIT handler
        # that kills this whole process tree when a child signals failure: keep ours, the workers report errors.
        previous = signal.getsignal(signal.SIGQUIT)
        _set_envs_and_config(server_args)
        signal.signal(signal.SIGQUIT, previous)
        return {"server_args": server_args, "port_args": PortArgs.init_new(server_args)}

    @staticmethod
    def load(payload: dict[str, Any], rank: int, gpu_id: int) -> Any:
        """One rank's ModelRunner with its pools and attention backends (aux capture configured inside)."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.runtime_context import SpawnRanks, get_device, get_model, publish, spawn_world_rank

        server_args, port_args = payload["server_args"], payload["port_args"]
        cfg = resolving_view(server_args)
        publish(server_args, role="scheduler",
                ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=rank, pp_rank=0), gpu_id=gpu_id))
        for init in (initialize_moe_config, initialize_fp8_gemm_config, initialize_bf16_gemm_config,
                     initialize_fp4_gemm_config):
            init()
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device,
                                        dist_port=port_args.nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(model_config=model_config, mem_fraction_static=cfg.mem_fraction_static, gpu_id=gpu_id,
                             nccl_port=port_args.nccl_port, server_args=server_args)
        overlap = get_model().is_startup_weight_load_overlap
        if overlap:
            runner.start_startup_weight_load()
        runner.alloc_memory_pool()
        # configure_aux_hidden_state_capture inside calls model.set_eagle3_layers_to_capture(ids)
        runner.init_attention_backends()
        runner.init_cuda_graphs()  # disabled by the server arguments: sets up the eager path only
        if overlap:
            runner.finalize_startup_weight_load()
        if cfg.tp_size > 1:
            torch.distributed.barrier()
        return runner

    @staticmethod
    def runner_info(runner: Any) -> dict[str, Any]:
        from sglang.srt.runtime_context import get_schedule

        return {
            "layers_to_capture": capture_layers_of(runner.model),
            "model_class": type(runner.model).__name__,
            "max_tokens": int(runner.max_total_num_tokens),
            "max_requests": int(runner.req_to_token_pool.size) - 1,  # slot 0 is kept as padding
            "context_len": int(runner.model_config.context_len),
            "chunk_tokens": get_schedule().chunked_prefill_size,
            "hidden_size": int(runner.model_config.hidden_size),
            "num_hidden_layers": int(runner.model_config.num_hidden_layers),
        }

    @staticmethod
    @torch.no_grad()
    def extend(runner: Any, seqs: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One prefill of ``seqs`` from an empty cache -> (aux [sum T, A*H], final [sum T, H]) on the GPU."""
        from array import array

        from sglang.benchmark.one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        # Every batch starts from empty pools: no prefix is reused, every token is computed and captured.
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for i, ids in enumerate(seqs):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params,
                      return_hidden_states=True)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1  # no input logprobs: logits only for each sequence's last token
            req.extend_end = len(ids)
            reqs.append(req)
        cache = TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                                   token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
        batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                       token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=cache,
                                       model_config=runner.model_config, enable_overlap=False,
                                       spec_algorithm=SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        _maybe_prepare_mlp_sync_batch(batch, runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                              return_hidden_states_before_norm=False)
        out = runner.forward(forward_batch).logits_output
        if getattr(out, "hidden_states_token_indices", None) is not None:
            raise SGLangCaptureError("SGLang captured only a subset of the tokens (hidden_states_token_indices is set)")
        return out.hidden_states, out.last_hidden_states

    @staticmethod
    def release(runner: Any) -> None:
        from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


# ---- worker processes -----------------------------------------------------------------------------------

def _to_shared_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """Copy into shared memory once, so the queue hands the parent the storage without another copy."""
    if t is None:
        return None
    out = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    out.copy_(t)
    return out


def _next_job(inbox: Any, parent_pid: int) -> Any:
    """The parent's next message; None when it says stop or has died (a worker must not outlive it)."""
    while True:
        try:
            return inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def _worker_main(backend: Any, payload: Any, rank: int, gpu_id: int, inbox: Any, outbox: Any, parent_pid: int) -> None:
    """One tensor-parallel rank: load, report, then run every batch the parent sends (all ranks run each
    forward together; only rank 0 sends the states back)."""
    runner = None
    try:
        runner = backend.load(payload, rank, gpu_id)
        outbox.put(("ready", rank, backend.runner_info(runner) if rank == 0 else None))
        while (job := _next_job(inbox, parent_pid)) is not None:
            batch_id, seqs = job
            aux, final = backend.extend(runner, seqs)
            if rank == 0:
                outbox.put(("result", rank, batch_id, _to_shared_cpu(aux), _to_shared_cpu(final)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("error", rank, traceback.format_exc()))
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                backend.release(runner)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start spawned workers without re-running ``__main__`` in them.

    A spawned child imports the parent's main script unless it is hidden; the hidden rule's Snakemake script
    has top-level code (it would capture again in every rank). The workers need only this module."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


class SGLangCapture:
    """Capture backend for aerie.hidden: EAGLE-3 aux states + final post-norm states through SGLang.

    >>> cap = SGLangCapture("/models/Kimi-K2.5", [1, 29, 57], tp_size=8, trust_remote_code=True)
    >>> [(aux, final)] = cap.capture([torch.tensor(ids)])  # aux [T, 3*7168], final [T, 7168], CPU
    >>> cap.close()
    """

    backend: Any = SGLang0523
    early_mapping_check = True  # refuse ids SGLang is known to map differently before loading the model
    startup_timeout_s = 7200.0  # loading Kimi K2.5 on 8 GPUs takes many minutes
    batch_timeout_s = 3600.0
    poll_s = 1.0
    stop_grace_s = 30.0

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    def __init__(self, target_path: str, layer_ids: list[int], *, dtype: str = "auto", **sglang_kwargs: Any):
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._closed = False
        self._batch_id = 0
        version = self.backend.installed_version()
        if version != TESTED_SGLANG_VERSION and os.environ.get(ANY_VERSION_ENV) != "1":
            raise SGLangUnavailableError(
                f"SGLang {version} is installed; aerie's SGLang capture uses internals of SGLang {TESTED_SGLANG_VERSION} "
                f"(envs/sglang.yaml). Install that version, or set {ANY_VERSION_ENV}=1 to try this one "
                f"(then run `python -m aerie.sglang_capture check` first)")
        self.sglang_version = version
        config_path = Path(target_path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: the SGLang capture needs a local model folder")
        dims = target_dims(json.loads(config_path.read_text()))
        self.num_hidden_layers, self.hidden_size, self.vocab_size = (
            dims["num_hidden_layers"], dims["hidden_size"], dims["vocab_size"])
        self.layer_ids = check_servable_aux_layer_ids(layer_ids, self.num_hidden_layers)
        if self.early_mapping_check:
            predicted = predicted_capture_inputs(dims["architectures"], self.layer_ids)
            check_capture_mapping(self.layer_ids, predicted, "/".join(dims["architectures"]) or str(target_path))
        self.server_kwargs = sglang_server_kwargs(target_path, self.layer_ids, dtype, sglang_kwargs)
        payload = self.backend.prepare(self.server_kwargs)

        ctx = torch.multiprocessing.get_context("spawn")
        self._outbox = ctx.Queue()
        atexit.register(self.close)
        try:
            with _main_module_hidden():
                for rank, gpu in enumerate(gpu_ids(self.server_kwargs)):
                    inbox = ctx.Queue()
                    # Not daemonic: SGLang may start processes of its own. close() (also at exit) stops them, and a
                    # worker whose parent died stops by itself.
                    proc = ctx.Process(target=_worker_main, name=f"aerie-sglang-capture-tp{rank}",
                                       args=(self.backend, payload, rank, gpu, inbox, self._outbox, os.getpid()))
                    proc.start()
                    self._procs.append(proc)
                    self._inboxes.append(inbox)
            info = None
            for _ in self._procs:
                msg = self._receive(("ready",), self.startup_timeout_s, "loading the target")
                info = msg[2] if msg[1] == 0 else info
            self.info: dict[str, Any] = info
            # The authority: what the loaded model will really capture.
            check_capture_mapping(self.layer_ids, info["layers_to_capture"], info.get("model_class", "the target"))
            if info["hidden_size"] != self.hidden_size or info["num_hidden_layers"] != self.num_hidden_layers:
                raise SGLangCaptureError(
                    f"SGLang's model config has {info['num_hidden_layers']} layers x {info['hidden_size']}, "
                    f"{config_path} says {self.num_hidden_layers} x {self.hidden_size}")
        except BaseException:
            self.close()
            raise

    def capture(self, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per 1-D int sequence: (aux [T, A*H], final [T, H]) on CPU, in SGLang's dtype; aux = the
        decoder-layer outputs for the aux ids concatenated in ascending id order (= transformers
        output_hidden_states[id + 1]); final = the post-norm last hidden state at every position."""
        if self._closed:
            raise SGLangCaptureError("this SGLangCapture is closed (after close() or a failed capture)")
        ids = check_sequences(seqs, self.vocab_size)
        info = self.info
        out: list[Any] = [None] * len(ids)
        try:
            for fwd in plan_forwards([len(s) for s in ids], max_tokens=info["max_tokens"],
                                     max_requests=info["max_requests"], context_len=info["context_len"],
                                     chunk_tokens=info.get("chunk_tokens")):
                self._batch_id += 1
                for inbox in self._inboxes:  # every rank runs the same forward (their collectives pair up)
                    inbox.put((self._batch_id, [ids[i] for i in fwd]))
                msg = self._receive(("result",), self.batch_timeout_s, "capturing")
                if msg[2] != self._batch_id:
                    raise SGLangCaptureError(f"rank 0 answered batch {msg[2]}, expected {self._batch_id}")
                pieces = split_capture(msg[3], msg[4], [len(ids[i]) for i in fwd], len(self.layer_ids), self.hidden_size)
                for i, piece in zip(fwd, pieces):
                    out[i] = piece
        except BaseException:
            # A failed rank leaves the others inside a collective: the workers cannot be reused.
            self.close()
            raise
        return out

    def _receive(self, kinds: tuple[str, ...], timeout: float, doing: str) -> tuple:
        """The next message of one of ``kinds``; raises on a worker's error, a dead worker, or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._outbox.get(timeout=self.poll_s)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    with contextlib.suppress(queue.Empty):  # an error message may have been sent just before exit
                        msg = self._outbox.get(timeout=self.poll_s)
                        if msg[0] == "error":
                            raise SGLangCaptureError(
                                f"SGLang worker rank {msg[1]} failed while {doing}:\n{msg[2]}") from None
                    raise SGLangCaptureError(f"SGLang worker(s) exited while {doing}: "
                                             + ", ".join(f"rank {r} (exit code {c})" for r, c in dead)) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer from the SGLang workers after {timeout:.0f} s while {doing}") from None
                continue
            if msg[0] == "error":
                raise SGLangCaptureError(f"SGLang worker rank {msg[1]} failed while {doing}:\n{msg[2]}")
            if msg[0] in kinds:
                return msg
            raise SGLangCaptureError(f"unexpected message {msg[0]!r} from SGLang worker rank {msg[1]} while {doing}")

    def close(self) -> None:
        """Stop the workers (a normal exit first, then SIGTERM, then SIGKILL); idempotent."""
        self._closed = True
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._inboxes = [], []
        atexit.unregister(self.close)

    def __enter__(self) -> SGLangCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- GPU-host check: SGLang's capture against transformers -----------------------------------------------

def _tiny_config(kind: str) -> Any:
    """Small random targets SGLang's GPU kernels accept (MLA needs Kimi's real head dims)."""
    from transformers import DeepseekV3Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                           tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if kind == "deepseek":
        return DeepseekV3Config(
            vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096,
            tie_word_embeddings=False, architectures=["DeepseekV3ForCausalLM"])
    raise ValueError(f"unknown tiny target {kind!r} (llama, deepseek)")


def make_tiny_target(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight target folder in bf16 (for ``check`` on a GPU host without a real model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(kind), dtype=torch.bfloat16)
    with torch.no_grad():  # larger than the default init: states differ clearly from layer to layer
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@torch.no_grad()
def compare_with_transformers(target: Path, layer_ids: list[int], captured: list[tuple[torch.Tensor, torch.Tensor]],
                              seqs: list[torch.Tensor], *, trust_remote_code: bool = False) -> dict[str, Any]:
    """Per aux id: which transformers hidden state SGLang's tensor is closest to (must be index id + 1) and
    how close; the same for the final state, plus greedy next-token agreement through lm_head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    dev = next(model.parameters()).device
    H = model.config.get_text_config().hidden_size
    per_id: dict[int, dict[str, Any]] = {i: {"errors": {}} for i in layer_ids}
    final_err, agree, total = [], 0, 0
    for ids, (aux, final) in zip(seqs, captured):
        out = model(ids[None].to(dev), output_hidden_states=True)
        hs = [h[0].cpu() for h in out.hidden_states]  # [0] embeddings, [k] = output of layer k-1
        ref_final = model.get_decoder()(ids[None].to(dev)).last_hidden_state[0].cpu()
        for j, i in enumerate(layer_ids):
            got = aux[:, j * H:(j + 1) * H]
            for k in (i, i + 1, i + 2):  # the right index, and both off-by-one neighbours
                if k < len(hs):
                    per_id[i]["errors"].setdefault(k, []).append(_rel_err(got, hs[k]))
        final_err.append(_rel_err(final, ref_final))
        pred = out.logits[0].argmax(-1).cpu()
        mine = model.get_output_embeddings()(final.to(dev, torch.float32)).argmax(-1).cpu()
        agree += int((pred == mine).sum())
        total += len(pred)
    ok = True
    for i, row in per_id.items():
        row["errors"] = {k: max(v) for k, v in row["errors"].items()}
        row["closest_hidden_states_index"] = min(row["errors"], key=row["errors"].get)
        row["ok"] = row["closest_hidden_states_index"] == i + 1 and row["errors"][i + 1] < 0.05
        ok &= row["ok"]
    report = {"aux": per_id, "final_rel_err": max(final_err), "argmax_agreement": agree / total}
    report["ok"] = ok and report["final_rel_err"] < 0.05 and report["argmax_agreement"] > 0.9
    return report


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aerie.sglang_capture",
                                 description="GPU-host checks of aerie's SGLang capture backend.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-tiny", help="write a random-weight target folder (llama or deepseek)")
    mk.add_argument("kind", choices=["llama", "deepseek"])
    mk.add_argument("out", type=Path)
    ck = sub.add_parser("check", help="capture with SGLang and compare with transformers (exit 1 on a mismatch)")
    ck.add_argument("--target", type=Path, required=True,
                    help="a model transformers can also load on one GPU in fp32 (make-tiny, the demo target)")
    ck.add_argument("--layers", type=int, nargs="+", required=True, help="aerie aux ids (decoder-layer outputs)")
    ck.add_argument("--tp", type=int, default=1)
    ck.add_argument("--seqs", type=int, default=4)
    ck.add_argument("--len", type=int, default=96, help="tokens per sequence (lengths vary from len/2 to len)")
    ck.add_argument("--trust-remote-code", action="store_true")
    ck.add_argument("--mem-fraction-static", type=float, default=0.5)
    ck.add_argument("--expect-refusal", action="store_true",
                    help="the ids must be refused by the check on the LOADED model (the early prediction is skipped)")
    ck.add_argument("--out", type=Path, help="write the report (JSON), with the flat output shapes SGLang returned")
    a = ap.parse_args(argv)
    if a.cmd == "make-tiny":
        print(make_tiny_target(a.kind, a.out))
        return

    class Checked(SGLangCapture):
        early_mapping_check = not a.expect_refusal  # --expect-refusal exercises the check on the loaded model

    cls = Checked
    kwargs = {"tp_size": a.tp, "mem_fraction_static": a.mem_fraction_static, "trust_remote_code": a.trust_remote_code}
    if a.expect_refusal:
        try:
            cls(str(a.target), a.layers, **kwargs).close()
        except SGLangCaptureError as e:
            print(f"PASS: refused as expected:\n{e}")
            return
        print("FAIL: SGLang accepted ids it maps differently")
        sys.exit(1)
    dims = target_dims(json.loads((a.target / "config.json").read_text()))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(2, a.len // 2), a.len + 1, (a.seqs,), generator=gen).tolist()
    seqs = [torch.randint(0, dims["vocab_size"], (n,), generator=gen) for n in lengths]
    started = time.perf_counter()
    with cls(str(a.target), a.layers, **kwargs) as cap:
        load_s = time.perf_counter() - started
        t0 = time.perf_counter()
        captured = cap.capture(seqs)
        capture_s = time.perf_counter() - t0
        info = cap.info
    report = compare_with_transformers(a.target, cap.layer_ids, captured, seqs, trust_remote_code=a.trust_remote_code)
    report.update({"sglang_version": cap.sglang_version, "target": str(a.target), "layer_ids": a.layers, "tp": a.tp,
                   "lengths": lengths, "runner_info": info, "load_s": round(load_s, 1), "capture_s": round(capture_s, 3),
                   "shapes": [{"aux": list(x.shape), "final": list(f.shape), "dtype": str(x.dtype)} for x, f in captured]})
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    print("PASS" if report["ok"] else "FAIL")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
