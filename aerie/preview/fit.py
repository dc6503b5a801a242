"""The fit plan: every GPU job's estimated peak memory per GPU against the host's GPU memory, decided before any job
runs (``snakemake -n`` prints it; a job that cannot fit fails the parse, the dry run's and the real run's, naming the
setting to change). Torch-free: Snakemake calls it while it reads the workflow.

The host's memory per GPU: ``resources.gpu_memory_gib``, else the smallest GPU ``nvidia-smi`` reports, else unknown
(a CPU-only machine planning a GPU run): the plan is then printed for the job's own device without a verdict and
says what to set. The jobs and what each counts, per GPU (the job's fullest GPU):

- ``hidden`` (capture). ``hf``: the whole target on the job's first GPU (aerie.hidden.backends loads it there) +
  one forward of ``hidden.batch_tokens`` tokens (the hooks' aux and final states, one layer's working tensors;
  on the CPU also attention's score matrix) + the top-k head's fp32 workspace (per sequence, in row blocks:
  :func:`topk_workspace_bytes`). ``sglang``: SGLang's static share
  ``mem_fraction_static`` x the GPU (weights / TP + its KV pool; on GPU 0 also aerie's lm_head copy, placed before
  SGLang sizes its pool, so the pool shrinks by it: aerie.hidden.sglang.mapping.lm_head_copy) + one forward
  outside it: SGLang's ``chunked_prefill_size`` tokens, or one longest sequence (``tokens.max_seq_len``), which
  runs alone, at most ``batch_tokens``. Checked too: the static share holds the weights,
  the copy and the KV of one longest sequence (``tokens.max_seq_len``).
- ``drafter`` (training): the drafter kind's ``training_memory`` (EAGLE-3:
  :func:`aerie.drafter_kinds.eagle3.memory.estimate_training_memory`; DFlash: its shape's): parameters, gradients,
  AdamW state, frozen embeddings, the largest batch the settings allow and its activations, a replica per GPU.
- ``bench``. ``inprocess``: the target placed as aerie.target_model.placement places it (one GPU, or spread over the
  job's GPUs with device_map; refused when it cannot fit them, naming ``bench.backend: sglang``) + the trained and
  the untrained drafter + the target's KV cache for one prompt (the longest of the plan's first prompts) and
  ``bench.max_new_tokens``. ``sglang``: the server's static share ``sglang.mem_fraction_static`` (<= 1) + a
  prefill chunk outside it; its static share must hold the weights / ``sglang.tp``, the drafter and one request's KV.
- ``responses`` in-process (``hf``, or ``serve: transformers``): the whole target on one GPU + the KV cache of
  ``responses.batch_size`` sequences of that prompt + ``max_new_tokens`` + their logits.

Every GPU job also counts ``RUNTIME_BYTES`` (the CUDA context, cuBLAS/NCCL workspaces, allocator slack). These
are estimates from the code's structure and the target's config.json, not measurements: on the CPU the demo's and
the rehearsal's jobs are compared with their measured peak RSS (tests/test_pipeline_e2e.py,
tests/test_kimi_rehearsal.py); on a GPU, ``torch.cuda.max_memory_allocated`` of a real run is the check to make
(every job's log ends with both: aerie.tools.rulelog.peak_memory_line).
"""

from __future__ import annotations

import itertools
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.benchmark.settings import resolve_references
from aerie.drafter_kinds import kind_of_folder
from aerie.drafter_kinds.folders import read_folder_config
from aerie.drafter_kinds.kind import TargetView
from aerie.formats.backends import stage_backend
from aerie.formats.prompts import estimate_prompt_tokens
from aerie.formats.responses import is_in_process, loads_target
from aerie.hidden.sglang.mapping import TOPK_CHUNK_ELEMENTS, TOPK_LIVE_TEMPORARIES, lm_head_copy
from aerie.plan.drafters import drafter_layer_ids, planned_drafters
from aerie.plan.environments import SGLANG_SETTINGS, uses_sglang
from aerie.plan.resolve import api_run, responses_config
from aerie.preview.disk import expected_tokens_per_sample, pending_hidden, target_hidden_size
from aerie.preview.host import HostNeeds
from aerie.preview.money import cost_preview
from aerie.prompts.bench_sets import SETS_DIR, bench_sets, read_bench_set
from aerie.sources.datasets import iter_planned_prompts, prompt_cache_dir, prompts_at
from aerie.sources.tables import PromptSourceError
from aerie.target_model.placement import plan_placement, stored_weights
from aerie.targets import planned_target
from aerie.tools.artifacts import read_jsonl

GIB = 1024**3
RUNTIME_BYTES = 2 * GIB  # per GPU job: CUDA context (~0.5 GiB), cuBLAS / NCCL workspaces, allocator fragmentation
# Prompt tokens allowed for per sequence in the benchmark's and generation's KV cache when the plan's prompts are not
# given (fit_plan's ``plans``: then the longest of the first prompts of each dataset, ~4 characters a token).
PROMPT_TOKENS = 2048
PROMPTS_SAMPLED = 200
SGLANG_DEFAULT_STATIC = 0.9  # the static share checked when sglang/hidden.sglang set no mem_fraction_static
# SGLang's chunked_prefill_size unless set, on GPUs of 35 to 160 GB (H100, H200; server_args.py): one forward's tokens
SGLANG_PREFILL_CHUNK = 8192
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- the target ----------------------------------------------------------------------------------------------


@dataclass
class TargetFacts:
    """What the plan knows of the target: its text config (None: unknown) and its weight bytes as stored."""

    text: dict[str, Any] | None
    weights: int | None  # bytes of the weights as stored (a float folder loaded in another dtype is rescaled)
    stored_dtype_bytes: int | None  # bytes per element of the stored float weights, when they are all one dtype
    config_from: str
    weights_from: str

    def loaded_weights(self, load_dtype_bytes: int) -> int | None:
        """Bytes once loaded in a float dtype of ``load_dtype_bytes`` (an int4/quantized folder as stored)."""
        if self.weights is None or self.stored_dtype_bytes is None:
            return self.weights
        return self.weights * load_dtype_bytes // self.stored_dtype_bytes


def decoder_parameters(text: dict[str, Any]) -> int:
    """Parameters of a Llama-style or DeepSeek-V3-style (MLA, MoE) causal LM from its text config.json."""
    H, L, V = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    heads = int(text["num_attention_heads"])
    if text.get("kv_lora_rank"):  # multi-latent attention
        nope, rope, v = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"]), int(text["v_head_dim"])
        q_lora, kv_lora = text.get("q_lora_rank"), int(text["kv_lora_rank"])
        q = H * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else H * heads * (nope + rope)
        attn = q + H * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * H
    else:
        hd = int(text.get("head_dim") or H // heads)
        kvh = int(text.get("num_key_value_heads") or heads)
        attn = H * heads * hd + 2 * H * kvh * hd + heads * hd * H
    dense = 3 * H * int(text["intermediate_size"])
    experts = int(text.get("n_routed_experts") or 0)
    if experts:
        moe_i = int(text["moe_intermediate_size"])
        moe = (experts + int(text.get("n_shared_experts") or 0)) * 3 * H * moe_i + experts * H  # + the router
        first_dense = int(text.get("first_k_dense_replace") or 0)
        mlp = first_dense * dense + (L - first_dense) * moe
    else:
        mlp = L * dense
    embed = V * H * (1 if text.get("tie_word_embeddings") else 2)
    return embed + L * (attn + 2 * H) + mlp + H


def target_facts(config: dict[str, Any]) -> TargetFacts:
    """The target's text config and weight bytes: from its folder (config.json; safetensors headers) when it is
    there, else from the config (a pipeline-built target's own settings; ``target.config_json`` and
    ``target.weights_gib`` for a target not on this machine)."""
    target = config["target"]
    folder = Path(target["path"])
    planned = planned_target(target)
    text, config_from = (planned.text_config, planned.source) if planned else (None, "")

    stored = stored_weights(folder) if folder.is_dir() else None
    if stored is not None:
        weights, dtype_bytes = stored
        weights_from = f"{folder}/*.safetensors headers"
    elif target.get("weights_gib"):
        weights, dtype_bytes, weights_from = int(target["weights_gib"] * GIB), None, "target.weights_gib"
    elif planned is not None and planned.bytes_per_parameter:  # a target the pipeline builds
        weights, dtype_bytes = planned.bytes_per_parameter * decoder_parameters(text), planned.bytes_per_parameter
        weights_from = f"{config_from} (parameters x {dtype_bytes} bytes)"
    else:
        weights, dtype_bytes, weights_from = None, None, ""
    return TargetFacts(text, weights, dtype_bytes, config_from, weights_from)


def kv_bytes_per_token(text: dict[str, Any], dtype_bytes: int, *, latent: bool) -> int:
    """KV-cache bytes per token, all layers. ``latent``: MLA as SGLang caches it (the compressed latent + rope
    key); otherwise as transformers caches it (MLA keys and values per head)."""
    L, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    if text.get("kv_lora_rank"):
        rope = int(text["qk_rope_head_dim"])
        if latent:
            return L * dtype_bytes * (int(text["kv_lora_rank"]) + rope)
        return L * dtype_bytes * heads * (int(text["qk_nope_head_dim"]) + rope + int(text["v_head_dim"]))
    hd = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return L * dtype_bytes * 2 * int(text.get("num_key_value_heads") or heads) * hd


def forward_bytes_per_token(text: dict[str, Any], dtype_bytes: int, *, tp: int = 1, captured: int = 0) -> int:
    """Activation bytes per token of one inference forward (no gradients: one layer's working set at a time):
    the residual stream and ~5 working copies of the hidden state, ``captured`` hidden states kept to the end,
    attention's query/key/value/output for the rank's heads, and the MLP's intermediates (MoE: each routed
    token's gate/up/down buffers of the rank's share, and its expert outputs before they are summed)."""
    H, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    per = (6 + captured) * H
    if text.get("kv_lora_rank"):
        head = 2 * (int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])) + 2 * int(text["v_head_dim"])
    else:
        head = 4 * int(text.get("head_dim") or H // heads)
    per += math.ceil(heads / tp) * head
    experts = int(text.get("num_experts_per_tok") or 0) if text.get("n_routed_experts") else 0
    if experts:
        per += experts * (H + 3 * math.ceil(int(text["moe_intermediate_size"]) / tp))
    per += 3 * math.ceil(int(text["intermediate_size"]) / tp)
    return per * dtype_bytes


def draft_vocab_size(config: dict[str, Any], text: dict[str, Any]) -> int:
    """``vocab.draft_vocab_size``, at most the target's vocabulary (what aerie.vocab.draft_vocab selects)."""
    return min(int(config["vocab"]["draft_vocab_size"]), int(text["vocab_size"]))


def drafter_weight_bytes(config: dict[str, Any], text: dict[str, Any], dtype_bytes: int) -> int:
    """The run's trained drafters' own parameters, all of them (their embeddings and heads that are the target's are
    not counted again)."""
    view = TargetView(text)
    total = 0
    for d in planned_drafters(config, Path.cwd()):
        kind = d.train.drafter_kind
        layers = drafter_layer_ids(d, view, config["hidden"].get("aux_layer_ids"))
        shape = kind.shape(d.train.kind_settings, view, draft_vocab_size(config, text), layers)
        total += kind.serving_weight_bytes(shape, dtype_bytes)
    return total


# ---- the plan ------------------------------------------------------------------------------------------------


@dataclass
class JobFit:
    """One GPU job's estimate on its fullest GPU."""

    rule: str
    gpus: int  # GPUs the job holds (0: it runs on the CPU)
    where: str  # which GPU the parts are on
    parts: dict[str, int] = field(default_factory=dict)  # bytes
    setting: str = ""  # what to change when it does not fit
    refusal: str = ""  # it cannot run at all with these settings (checked before the memory)
    unknown: str = ""  # why it cannot be estimated
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self, gpu_bytes: int | None) -> bool | None:
        if self.refusal:
            return False
        if gpu_bytes is None or self.unknown or not self.gpus:
            return None
        return self.total <= gpu_bytes

    def line(self, gpu_bytes: int | None) -> str:
        head = f"  {self.rule:<9} {self.gpus} GPU{'s' if self.gpus != 1 else ''}, {self.where}: "
        if self.unknown:
            return head + f"not estimated: {self.unknown}"
        parts = ", ".join(f"{name} {size / GIB:,.2f}" for name, size in self.parts.items() if size)
        text = head + f"~{self.total / GIB:,.1f} GiB ({parts} GiB)"
        fits = self.fits(gpu_bytes)
        if self.refusal:
            text += f"\n    CANNOT RUN: {self.refusal}"
        elif fits is True:
            text += f": fits, {100 * (1 - self.total / gpu_bytes):.0f}% free"
        elif fits is False:
            text += f"\n    DOES NOT FIT: {self.total / GIB:,.1f} GiB > {gpu_bytes / GIB:,.1f} GiB; {self.setting}"
        return text + "".join(f"\n    {n}" for n in self.notes)


@dataclass
class FitPlan:
    gpu_bytes: int | None
    gpu_source: str
    jobs: list[JobFit]

    def failures(self) -> list[JobFit]:
        return [j for j in self.jobs if j.fits(self.gpu_bytes) is False]

    def text(self) -> str:
        if self.gpu_bytes is None:
            head = (
                "aerie fit plan: GPU memory unknown (no resources.gpu_memory_gib, no nvidia-smi): the estimates "
                "below are for the job's own device here and are not checked; set resources.gpu_memory_gib to the "
                "GPU host's memory per GPU to check them"
            )
        else:
            head = f"aerie fit plan: {self.gpu_bytes / GIB:,.1f} GiB per GPU ({self.gpu_source})"
        return "\n".join([head, *(j.line(self.gpu_bytes) for j in self.jobs)])

    def error(self) -> str:
        """Why the run cannot start: each failing job with the setting to change."""
        reasons = []
        for j in self.failures():
            why = j.refusal or (
                f"~{j.total / GIB:,.1f} GiB per GPU does not fit {self.gpu_bytes / GIB:,.1f} GiB ({self.gpu_source}); "
                + j.setting
            )
            reasons.append(f"rule {j.rule}: {why}")
        return "; ".join(reasons)


def host_gpu_memory(config: dict[str, Any], nvidia_smi: str | None = "nvidia-smi") -> tuple[int | None, str]:
    """(bytes per GPU, where that came from): ``resources.gpu_memory_gib``, else the smallest GPU nvidia-smi
    reports, else (None, "")."""
    gib = config["resources"].get("gpu_memory_gib")
    if gib:
        return int(gib * GIB), "resources.gpu_memory_gib"
    smi = shutil.which(nvidia_smi) if nvidia_smi else None
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            mib = [int(float(x)) for x in out.stdout.split() if x.strip()]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            mib = []
        if out.returncode == 0 and mib:
            return min(mib) * 2**20, f"nvidia-smi: the smallest of {len(mib)} GPU(s)"
    return None, ""


def _dtype_bytes(config: dict[str, Any], on_gpu: bool) -> int:
    """The target's loading dtype: ``target.dtype``, ``auto`` = bf16 on a GPU, fp32 on the CPU."""
    name = config["target"].get("dtype", "auto")
    return DTYPE_BYTES.get(name, 2 if on_gpu else 4)


def _runtime(parts: dict[str, int], on_gpu: bool) -> dict[str, int]:
    return {**parts, "runtime": RUNTIME_BYTES} if on_gpu else parts


def _target_runtime(parts: dict[str, int], on_gpu: bool, facts: TargetFacts) -> dict[str, int]:
    """A job that loads the target: on a GPU, the CUDA runtime; on the CPU, the checkpoint's pages too. The CPU
    loader maps the safetensors files and keeps the mapping while any weight aliases it, so each page a weight is
    read from stays resident (and counted by RSS) beside the tensors transformers copies while converting: measured
    on the Kimi-shaped rehearsal target, 317 MiB resident for 172 MiB of weights once every weight was read."""
    if on_gpu or not facts.weights:
        return _runtime(parts, on_gpu)
    return {**parts, "checkpoint pages (CPU)": facts.weights}


def hidden_fit(config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None) -> JobFit:
    gpus = config["resources"]["hidden_gpus"]
    hcfg, text = config["hidden"], facts.text
    on_gpu = gpu_bytes is not None and gpus >= 1 and config["target"].get("device") != "cpu"
    a = _dtype_bytes(config, on_gpu)
    ids = hcfg.get("aux_layer_ids") or [0, 0, 0]
    fit = JobFit("hidden", gpus, "GPU 0", setting="lower hidden.batch_tokens")
    if text is None:
        fit.unknown = "the target's config.json is not here (set target.config_json)"
        return fit
    if stage_backend(config, "hidden").in_sglang:
        return _sglang_capture_fit(config, facts, gpu_bytes, fit, a, len(ids))
    weights = facts.loaded_weights(a)
    if weights is None:
        fit.unknown = "the target's weights are not here (set target.weights_gib)"
        return fit
    tokens = hcfg.get("batch_tokens", 8192)
    width = min(tokens, config["tokens"].get("max_seq_len", 4096))
    fit.where = "GPU 0 (the whole target)" if on_gpu else "the CPU"
    fit.parts = {"target weights": weights}
    fit.parts["forward"] = tokens * forward_bytes_per_token(text, a, captured=len(ids) + 1)
    if not on_gpu:  # PyTorch's CPU attention computes the [heads, T, T] fp32 scores of each sequence
        fit.parts["attention scores"] = tokens * width * int(text["num_attention_heads"]) * 4
    fit.parts["top-k workspace"] = topk_workspace_bytes(int(text["vocab_size"]), width, head_fp32=a == 4)
    fit.parts = _target_runtime(fit.parts, on_gpu, facts)
    fit.setting = (
        "lower hidden.batch_tokens, or set hidden.backend: sglang (tensor parallel over hidden.sglang.tp_size)"
    )
    return fit


def topk_workspace_bytes(vocab_size: int, longest_sequence: int, *, head_fp32: bool) -> int:
    """aerie.hidden.head.lm_head_topk's temporaries: it runs per sequence, in row blocks of at most
    TOPK_CHUNK_ELEMENTS fp32 logits; an fp32 head keeps two blocks alive (the logits and logsumexp's scratch), a
    bf16 one up to TOPK_LIVE_TEMPORARIES (its fp32 chunk copy and the logits being assembled too)."""
    rows = min(max(1, TOPK_CHUNK_ELEMENTS // vocab_size), max(1, longest_sequence))
    return (2 if head_fp32 else TOPK_LIVE_TEMPORARIES) * rows * vocab_size * 4


def _sglang_capture_fit(
    config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None, fit: JobFit, a: int, num_aux: int
) -> JobFit:
    opts = dict(config["hidden"].get("sglang") or {})
    tp = int(opts.get("tp_size", 1))
    text = facts.text
    static = float(opts.get("mem_fraction_static") or SGLANG_DEFAULT_STATIC)
    head = lm_head_copy(int(text["vocab_size"]), int(text["hidden_size"]), opts, config["target"].get("device", "auto"))
    weights = facts.loaded_weights(2)
    if tp > fit.gpus:
        fit.refusal = f"hidden.sglang.tp_size {tp} needs {tp} GPUs but resources.hidden_gpus is {fit.gpus}"
    # aerie sends batches of hidden.batch_tokens; the capture splits them into forwards of SGLang's
    # chunked_prefill_size, and a longer sequence runs alone (aerie.hidden.sglang.mapping.plan_forwards).
    longest = config["tokens"].get("max_seq_len", 4096)
    chunk = int(opts.get("chunked_prefill_size") or SGLANG_PREFILL_CHUNK)
    tokens = min(config["hidden"].get("batch_tokens", 8192), max(chunk, longest))
    if weights is None:
        fit.unknown = "the target's weights are not here (set target.weights_gib)"
        return fit
    fit.where = f"GPU {head.gpu if head.gpu is not None else 0} (SGLang rank 0 + aerie's lm_head copy)"
    if gpu_bytes is None:
        fit.parts = {"weights / TP": weights // tp, "lm_head copy + top-k workspace": head.bytes}
        fit.notes.append("SGLang's static share is a fraction of the GPU: known only with the GPU's memory")
    else:
        fit.parts = {f"SGLang static share ({static:.2f} x GPU)": int(static * gpu_bytes)}
    fit.parts["forward"] = tokens * forward_bytes_per_token(text, 2, tp=tp, captured=num_aux + 1)
    fit.parts["runtime"] = RUNTIME_BYTES
    kv = longest * kv_bytes_per_token(text, 2, latent=True)
    fit.notes.append(
        f"inside the static share: weights / TP {weights / tp / GIB:,.1f} GiB, {head.describe()}, KV pool >= one "
        f"{longest:,}-token sequence {kv / GIB:,.2f} GiB (tokens.max_seq_len)"
    )
    if gpu_bytes is not None and not fit.refusal:
        room = static * gpu_bytes - weights / tp - (head.bytes if head.gpu is not None else 0)
        if room < kv:
            fit.refusal = (
                f"SGLang's static share ({static:.2f} x {gpu_bytes / GIB:,.0f} GiB) leaves {room / GIB:,.1f} GiB for "
                f"its KV pool after the weights / TP and the lm_head copy, less than one {longest:,}-token sequence "
                f"({kv / GIB:,.2f} GiB): raise hidden.sglang.mem_fraction_static or hidden.sglang.tp_size (and "
                "resources.hidden_gpus)"
            )
    fit.setting = (
        "lower hidden.sglang.mem_fraction_static (it leaves the rest of each GPU for the forward), or "
        "hidden.batch_tokens / hidden.sglang.chunked_prefill_size"
    )
    return fit


def drafter_fits(config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None) -> list[JobFit]:
    """One line per drafter of the run (each trains in its own job): its kind's estimate of one training process
    (a replica per GPU under DDP: parameters, gradients and AdamW are not sharded)."""
    gpus = config["resources"]["drafter_gpus"]
    drafters = planned_drafters(config, Path.cwd())
    fits = []
    for d in drafters:
        train, kind = d.train, d.train.drafter_kind
        on_gpu = gpu_bytes is not None and gpus >= 1 and train.device != "cpu"
        label = "drafter" if len(drafters) == 1 else f"drafter {d.name}"
        fit = JobFit(label, gpus, "each GPU (a replica per GPU)" if on_gpu else "the CPU")
        fits.append(fit)
        if facts.text is None:
            fit.unknown = "the target's config.json is not here (set target.config_json)"
            continue
        view = TargetView(facts.text)
        layers = drafter_layer_ids(d, view, config["hidden"].get("aux_layer_ids"))
        vocab = draft_vocab_size(config, facts.text)
        memory = kind.training_memory(train, view, vocab, layers, on_gpu=on_gpu, hidden=config["hidden"])
        fit.parts = _runtime(dict(memory.parts), on_gpu)
        fit.notes.append(
            f"{kind.name}: the largest batch: {memory.batch_tokens:,} tokens in windows of {memory.window:,} "
            "(drafter.max_batch_tokens, else batch_size x max_seq_len)"
        )
        shape = kind.shape(train.kind_settings, view, vocab, layers)
        params = kind.trainable_parameters(shape)
        fit.notes.append(
            f"{params / 1e9:,.2f}B trainable parameters: fp32 weights, gradients and AdamW = {16 * params / GIB:,.1f} "
            "GiB per replica (DDP: each GPU holds all of it; a GPU that cannot would need the optimizer state "
            "sharded, which aerie does not do)"
        )
        host = kind.host_memory(train, view, vocab, layers, max(1, gpus) if on_gpu else 1, hidden=config["hidden"])
        fit.notes.append(host.describe())
        fit.setting = (
            "set drafter.max_batch_tokens (a token budget per batch), or lower drafter.max_seq_len / batch_size"
        )
    return fits


def bench_fit(config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None, prompt_tokens: int) -> JobFit:
    gpus = config["resources"]["bench_gpus"]
    bench, text = config["bench"], facts.text
    backend = stage_backend(config, "bench")
    on_gpu = gpu_bytes is not None and gpus >= 1 and config["target"].get("device") != "cpu"
    fit = JobFit("bench", gpus, "GPU 0" if on_gpu else "the CPU")
    if text is None:
        fit.unknown = "the target's config.json is not here (set target.config_json)"
        return fit
    if backend.in_sglang:
        return _sglang_bench_fit(config, facts, gpu_bytes, fit, prompt_tokens)
    a = _dtype_bytes(config, on_gpu)
    weights = facts.loaded_weights(a)
    if weights is None:
        fit.unknown = "the target's weights are not here (set target.weights_gib)"
        return fit
    sequence = prompt_tokens + bench.get("max_new_tokens", 128)
    kv = sequence * kv_bytes_per_token(text, a, latent=False)
    on = 1
    if on_gpu:
        try:
            placement = plan_placement(weights, [gpu_bytes] * max(gpus, 1))
        except ValueError as e:
            fit.refusal = str(e)
            placement = None
        if placement is not None and placement.kind == "spread":
            on = len(placement.max_memory)
            fit.where = f"GPU 0 of {on} (device_map: the target spread, the drafters beside its embeddings)"
    fit.parts = {"target weights": math.ceil(weights / on), "target KV cache": math.ceil(kv / on)}
    # In-process, each EAGLE-3 drafter holds its own copy of the target's input embeddings (Eagle3Drafter
    # .load_target_embeddings copies them; SGLang's EAGLE worker shares them): [V, H] each, Kimi's 2.35 GB in bf16.
    embeddings = int(text["vocab_size"]) * int(text["hidden_size"]) * a
    fit.parts.update(_inprocess_drafters(config, text, a, embeddings))
    fit.parts["forward"] = sequence * forward_bytes_per_token(text, a)
    # The prefill's logits over the whole prompt where the target's forward takes no logits_to_keep (remote-code
    # wrappers such as Kimi's: aerie.benchmark.speculative asks for the last position only where it can).
    fit.parts["prefill logits"] = prompt_tokens * int(text["vocab_size"]) * a
    fit.parts = _target_runtime(fit.parts, on_gpu, facts)
    fit.notes.append(f"one sequence of {prompt_tokens:,} prompt + bench.max_new_tokens tokens")
    fit.setting = "set bench.backend: sglang (tensor parallel over sglang.tp), or give the job more GPUs"
    return fit


def _inprocess_drafters(config: dict[str, Any], text: dict[str, Any], a: int, embeddings: int) -> dict[str, int]:
    """The drafters the in-process benchmark holds at once: each trained one and each drafter reference (its
    untrained twin, every drafter folder: its stored tensors at the target's dtype where the folder is here, else
    the first trained drafter's size), each with its own copy of the target's embeddings where its kind copies them
    (EAGLE-3; a DFlash drafter reads the target's own)."""
    view = TargetView(text)
    try:
        refs = resolve_references(config["bench"])  # relative folders: the workflow directory (cwd)
    except ValueError:
        refs = []  # the bench settings' own check names the problem
    parts: dict[str, int] = {}
    for d in planned_drafters(config, Path.cwd()):
        kind = d.train.drafter_kind
        layers = drafter_layer_ids(d, view, config["hidden"].get("aux_layer_ids"))
        shape = kind.shape(d.train.kind_settings, view, draft_vocab_size(config, text), layers)
        size = kind.serving_weight_bytes(shape, a) + (embeddings if kind.copies_target_embeddings else 0)
        parts[f"trained drafter {d.name}"] = size
        if any(r.role == "untrained" for r in refs):
            parts[f"untrained {d.name}"] = size
    first = next(iter(parts.values()))
    for r in refs:
        if r.role != "drafter":
            continue
        size = first
        if r.folder is not None:
            try:
                kind = kind_of_folder(read_folder_config(r.folder), str(r.folder))
                size = kind.folder_weight_bytes(r.folder, a) + (embeddings if kind.copies_target_embeddings else 0)
            except ValueError:
                pass  # refused with its reasons by the bench settings' check
        parts[f"reference {r.name}"] = size
    return parts


def _sglang_bench_fit(
    config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None, fit: JobFit, prompt_tokens: int
) -> JobFit:
    s = config.get("sglang") or {}
    tp, text = int(s.get("tp", 1)), facts.text
    static = float(s.get("mem_fraction_static") or SGLANG_DEFAULT_STATIC)
    fit.where = "each GPU (an SGLang TP rank)"
    if tp > fit.gpus:
        fit.refusal = f"sglang.tp {tp} needs {tp} GPUs but resources.bench_gpus is {fit.gpus}"
    weights = facts.loaded_weights(2)
    if weights is None:
        fit.unknown = "the target's weights are not here (set target.weights_gib)"
        return fit
    sequence = prompt_tokens + config["bench"].get("max_new_tokens", 128)
    needs = weights / tp + drafter_weight_bytes(config, text, 2) + sequence * kv_bytes_per_token(text, 2, latent=True)
    if gpu_bytes is None:
        fit.parts = {"weights / TP": int(weights / tp)}
        fit.notes.append("SGLang's static share is a fraction of the GPU: known only with the GPU's memory")
    else:
        fit.parts = {f"SGLang static share ({static:.2f} x GPU)": int(static * gpu_bytes)}
        if not fit.refusal and static * gpu_bytes < needs:
            fit.refusal = (
                f"sglang.mem_fraction_static {static:.2f} x {gpu_bytes / GIB:,.0f} GiB does not hold the weights / "
                f"sglang.tp ({weights / tp / GIB:,.1f} GiB), the drafter and one request's KV: raise "
                "sglang.mem_fraction_static or sglang.tp (and resources.bench_gpus)"
            )
    fit.parts["prefill chunk"] = SGLANG_PREFILL_CHUNK * forward_bytes_per_token(text, 2, tp=tp)
    fit.parts["runtime"] = RUNTIME_BYTES
    fit.notes.append(
        f"inside the static share: weights / TP {weights / tp / GIB:,.1f} GiB + drafter + the KV pool"
        + ("" if s.get("mem_fraction_static") else f" (sglang.mem_fraction_static not set: checked at {static})")
    )
    fit.setting = "lower sglang.mem_fraction_static (the rest of each GPU is the servers' working memory)"
    return fit


def responses_fit(
    config: dict[str, Any], facts: TargetFacts, gpu_bytes: int | None, prompt_tokens: int
) -> JobFit | None:
    """In-process generation or a loopback transformers server: the target on one GPU (None: no such dataset)."""
    settings = [responses_config(config, n) for n in config["datasets"]]
    local = [r for r in settings if loads_target(r)]
    if not local:
        return None
    gpus = config["resources"]["responses_gpus"]
    on_gpu = gpu_bytes is not None and gpus >= 1 and config["target"].get("device") != "cpu"
    fit = JobFit("responses", gpus, "GPU 0 (the whole target)" if on_gpu else "the CPU")
    text = facts.text
    a = _dtype_bytes(config, on_gpu)
    weights = facts.loaded_weights(a)
    if text is None or weights is None:
        fit.unknown = "the target's config.json or weights are not here (target.config_json, target.weights_gib)"
        return fit
    batch = max(r["batch_size"] if is_in_process(r["backend"]) else r.get("concurrency", 1) for r in local)
    sequence = prompt_tokens + max(r["max_new_tokens"] for r in local)
    fit.parts = {
        "target weights": weights,
        "KV cache": batch * sequence * kv_bytes_per_token(text, a, latent=False),
        "logits": batch * int(text["vocab_size"]) * 4 * 2,
        "forward": batch * prompt_tokens * forward_bytes_per_token(text, a),
    }
    fit.parts = _target_runtime(fit.parts, on_gpu, facts)
    fit.notes.append(f"{batch} sequences of {prompt_tokens:,} prompt + max_new_tokens tokens at once")
    fit.setting = "lower responses.batch_size / max_new_tokens, or regenerate through an API backend"
    return fit


def longest_prompt(config: dict[str, Any], plans: dict[str, Any]) -> int:
    """Estimated tokens of the longest of each dataset's first PROMPTS_SAMPLED planned and benchmark prompts (~4
    characters a token, as the cost preview), at most tokens.max_seq_len."""
    longest = 1
    for name, plan in plans.items():
        prompts = list(itertools.islice(iter_planned_prompts(plan, config["datasets"]), PROMPTS_SAMPLED))
        start, stop = plan.bench_range()
        cache = Path(plan.cache_dir) if plan.cache_dir else None
        bench = range(start, min(stop, start + PROMPTS_SAMPLED))
        prompts += prompts_at(name, config["datasets"][name], bench, config["datasets"], cache)
        longest = max([longest, *(estimate_prompt_tokens(p["messages"]) for p in prompts)])
    bench_set_prompts = _bench_set_prompts(config, PROMPTS_SAMPLED)
    longest = max([longest, *(estimate_prompt_tokens(p["messages"]) for p in bench_set_prompts)])
    return min(longest, config["tokens"].get("max_seq_len", 4096))


def _bench_set_prompts(config: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """The first prompts of each ``bench.sets`` set the benchmark decodes (HumanEval's are long): rule bench_set's
    file where it is written, else the set's source as that rule would read it; a set not readable yet (a Hub set
    not in the cache) is left out (the bench_set job names it)."""
    n = min(limit, int(config["bench"].get("max_prompts") or limit))
    out: list[dict[str, Any]] = []
    for name, spec in bench_sets(config).items():
        written = Path(SETS_DIR) / f"{name}.jsonl"
        try:
            records = read_jsonl(written) if written.exists() else None
            if records is None:
                records, _ = read_bench_set(name, spec, prompt_cache_dir(Path("results")), log=lambda _m: None)
        except (PromptSourceError, OSError, ValueError):
            continue
        out += list(records)[:n]
    return out


def fit_plan(
    config: dict[str, Any], plans: dict[str, Any] | None = None, nvidia_smi: str | None = "nvidia-smi"
) -> FitPlan:
    """Every GPU job of the run with its estimate. ``plans``: the shard plan (aerie.plan.resolve.plan_datasets), whose
    prompts bound the sequences the benchmark and in-process generation hold; without it PROMPT_TOKENS."""
    gpu_bytes, source = host_gpu_memory(config, nvidia_smi)
    facts = target_facts(config)
    prompt_tokens = longest_prompt(config, plans) if plans else PROMPT_TOKENS
    jobs = [j for j in (responses_fit(config, facts, gpu_bytes, prompt_tokens),) if j is not None]
    jobs += [hidden_fit(config, facts, gpu_bytes), *drafter_fits(config, facts, gpu_bytes)]
    jobs.append(bench_fit(config, facts, gpu_bytes, prompt_tokens))
    for job in jobs:
        if facts.weights_from and not job.unknown and not job.rule.startswith("drafter"):
            job.notes.append(f"target: weights from {facts.weights_from}, dims from {facts.config_from}")
    return FitPlan(gpu_bytes, source, jobs)


# ---- the host's floor (rule host_check) ----------------------------------------------------------------------


def capture_shm(config: dict[str, Any]) -> tuple[int | None, str]:
    """(bytes, how counted) of one SGLang capture batch through /dev/shm: rank 0 copies each forward's aux and final
    states into shared memory, and every forward of a batch stays there until the batch is split
    (aerie.hidden.sglang.worker). A batch holds at most hidden.batch_tokens, a longer sequence runs alone.
    (None, why) when the capture is not SGLang's or the target's hidden size is unknown."""
    if not stage_backend(config, "hidden").in_sglang:
        return None, "hidden.backend is not sglang: no capture batch passes through /dev/shm"
    hidden = target_hidden_size(config["target"])
    if hidden is None:
        return None, "the target's hidden size is unknown (set target.hidden_size)"
    batch, longest = config["hidden"].get("batch_tokens", 8192), config["tokens"].get("max_seq_len", 4096)
    states = len(config["hidden"].get("aux_layer_ids") or [0, 0, 0]) + 1
    a = DTYPE_BYTES.get(config["target"].get("dtype", "auto"), 2)
    tokens = max(batch, longest)
    return tokens * states * hidden * a, (
        f"one capture batch: max(hidden.batch_tokens {batch:,}, tokens.max_seq_len {longest:,}) tokens x {states} "
        f"states x {hidden:,} x {a} bytes"
    )


def host_needs(
    config: dict[str, Any],
    plans: dict[str, Any],
    results_dir: Path,
    *,
    conda_deployment: bool,
    fit: FitPlan | None = None,
    before: list[str] | None = None,
) -> Any:
    """What rule host_check asks of the host (aerie.preview.host.HostNeeds), from the plan: the GPUs of each GPU job
    (resources.<rule>_gpus) and the fit plan's largest estimate per GPU, the rules in SGLang's environment, one
    capture batch's shared memory (:func:`capture_shm`), the disk preview's pending hidden states."""
    fit = fit if fit is not None else fit_plan(config, plans)
    on_gpu = [j for j in fit.jobs if j.gpus >= 1]
    sized = [j for j in on_gpu if not j.unknown and j.parts and "the CPU" not in j.where]
    largest = max(sized, key=lambda j: j.total, default=None)
    # Offline (the quota cut needs no price) and never fatal: a torn shard or a journal being written must not stop
    # the DAG from being built; the disk check then says it cannot size the hidden states.
    try:
        preview = cost_preview(api_run(config, plans), results_dir, live=False)
        expected = {n: e.expected_samples for n, e in preview.datasets.items()} if preview is not None else None
        pending = pending_hidden(
            config, plans, results_dir, expected_tokens_per_sample(config, results_dir, plans), expected
        )
    except Exception:  # noqa: BLE001 - any unreadable input leaves only this check without its figure
        pending = None
    shm, shm_from = capture_shm(config)
    return HostNeeds(
        gpus=max((j.gpus for j in on_gpu), default=0),
        gpu_rules={j.rule: j.gpus for j in on_gpu},
        gpu_device=str(config["target"].get("device", "auto")),
        gpu_memory_bytes=largest.total if largest else None,
        gpu_memory_job=f"{largest.rule}, {largest.where}" if largest else "",
        sglang_rules=[r for r in SGLANG_SETTINGS if uses_sglang(config, r)],
        shm_bytes=shm,
        shm_from=shm_from,
        disk_bytes=pending.bytes if pending is not None else None,
        disk_path=str(results_dir),
        conda=conda_deployment,
        skip=list((config.get("host_check") or {}).get("skip") or []),
        before=list(before or []),
    )
