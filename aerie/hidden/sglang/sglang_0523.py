"""The part of the SGLang capture that touches SGLang internals, pinned to sglang 0.5.23 (envs/sglang.yaml).

Everything version-specific lives in :class:`SGLang0523`; another SGLang version gets its own module with a
class of the same shape (``installed_version``, ``prepare``, ``load``, ``runner_info``, ``extend``,
``release``), passed to :class:`aerie.hidden.sglang.SGLangCapture` as ``backend`` and checked with
``aerie-sglang-capture check --backend MODULE:CLASS``. The class must live in an importable module (never
``__main__``): the worker processes import it by name.
"""

from __future__ import annotations

import signal
from array import array
from typing import Any

import torch

from aerie.hidden.sglang.mapping import SGLangCaptureError, SGLangUnavailableError, capture_layers_of


def request_capacity(req_to_token_pool: Any) -> int:
    """How many requests one forward may hold: every free row of SGLang's request pool, emptied first.

    In 0.5.23 ``ReqToTokenPool(size)`` allocates ``size + 1`` rows and keeps row 0 as padding for CUDA-graph
    batches, so ``size`` rows are free (``free_slots = range(1, size + 1)``): ``size`` already excludes the
    padding row. Counting the free rows of the cleared pool stays right if a version changes that layout."""
    req_to_token_pool.clear()
    return int(req_to_token_pool.available_size())


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
                f"hidden.backend sglang needs SGLang, which is not importable here ({e}). SGLang pins its own torch "
                f"and transformers: run the hidden rule in its environment, envs/sglang.yaml (`snakemake --sdm "
                f"conda`), or `conda env create -f envs/sglang.yaml` on the GPU host"
            ) from e
        return str(getattr(sglang, "__version__", "unknown"))

    @staticmethod
    def prepare(server_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Resolve the server arguments once and pick the ports; the result is pickled to every rank."""
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
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, get_device, get_model, publish, spawn_world_rank

        server_args, port_args = payload["server_args"], payload["port_args"]
        cfg = resolving_view(server_args)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=rank, pp_rank=0), gpu_id=gpu_id),
        )
        for init in (
            initialize_moe_config,
            initialize_fp8_gemm_config,
            initialize_bf16_gemm_config,
            initialize_fp4_gemm_config,
        ):
            init()
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(
            server_args=server_args, device=get_device().device, dist_port=port_args.nccl_port
        )
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=cfg.mem_fraction_static,
            gpu_id=gpu_id,
            nccl_port=port_args.nccl_port,
            server_args=server_args,
        )
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
            "max_requests": request_capacity(runner.req_to_token_pool),
            "context_len": int(runner.model_config.context_len),
            "chunk_tokens": get_schedule().chunked_prefill_size,
            "hidden_size": int(runner.model_config.hidden_size),
            "num_hidden_layers": int(runner.model_config.num_hidden_layers),
        }

    @staticmethod
    @torch.no_grad()
    def extend(runner: Any, seqs: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One prefill of ``seqs`` from an empty cache -> (aux [sum T, A*H], final [sum T, H]) on the GPU."""
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
            req = Req(
                rid=str(i),
                origin_input_text="",
                origin_input_ids=array("q", ids),
                sampling_params=params,
                return_hidden_states=True,
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1  # no input logprobs: logits only for each sequence's last token
            req.extend_end = len(ids)
            reqs.append(req)
        cache = TreeCacheNamespace(
            page_size=get_schedule().page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        _maybe_prepare_mlp_sync_batch(batch, runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(
            batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False
        )
        out = runner.forward(forward_batch).logits_output
        if getattr(out, "hidden_states_token_indices", None) is not None:
            raise SGLangCaptureError("SGLang captured only a subset of the tokens (hidden_states_token_indices is set)")
        return out.hidden_states, out.last_hidden_states

    @staticmethod
    def release(runner: Any) -> None:
        from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
