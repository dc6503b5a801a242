"""Stage 2: prompts -> target responses (format ``aerie.responses/1``).

Backends share one record format. This module holds the in-process ``hf`` backend: the target
generates with transformers, so the exact sampled ids are kept. API backends (OpenRouter, any
OpenAI-compatible server, SGLang ``/generate``) write the same records without or with ids.

Rule ``responses_hf`` is one job for every in-process shard of the run (``generate_hf_shards``): the target is
loaded once, not once per shard, and each finished shard is kept in the generation store by the store job
(aerie.target_model.store.run_store_job) so a rerun after a crash generates only the missing shards, still with one
load.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aerie.formats.prompts import read_prompts
from aerie.formats.responses import IN_PROCESS, RESPONSES_FORMAT
from aerie.responses.sampling import Sampling
from aerie.target_model.chat import ChatFormat, read_chat_format, split_generated
from aerie.target_model.model import load_target, set_threads
from aerie.target_model.store import (
    GENERATION_STORE_DIR,
    StoreStage,
    file_sha256,
    generation_key,
    generation_settings,
    run_store_job,
    stored_generation,
    target_identity,
    write_generation_record,
)
from aerie.target_model.template import render_prompt_ids
from aerie.tools.artifacts import write_jsonl


def params_hash(model: str, params: dict[str, Any]) -> str:
    """Short stable hash of what determines a response: a changed parameter never reuses old work."""
    blob = json.dumps({"model": model, "params": params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class GenerationSession:
    """The target opened for in-process generation at most once, however many shards go through it.

    The load is lazy: a job whose shards are all reused from the generation store never loads the target.
    ``loads`` counts the loads (the job logs it; tests and bench/responses_loads.py assert it)."""

    def __init__(
        self,
        target_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        log: Callable[[str], None] = print,
    ):
        self.target_path, self.log = str(target_path), log
        self.device, self.dtype, self.trust_remote_code = device, dtype, trust_remote_code
        self.loads = 0
        self.load_seconds = 0.0
        self._opened: tuple[Any, Any, torch.device, ChatFormat] | None = None

    def open(self) -> tuple[Any, Any, torch.device, ChatFormat]:
        """(model, tokenizer, device, chat format); loads the target on the first call only."""
        if self._opened is None:
            self.log(f"loading the target {self.target_path} for in-process generation")
            started = time.perf_counter()
            model, tok, dev = load_target(
                self.target_path, device=self.device, dtype=self.dtype, trust_remote_code=self.trust_remote_code
            )
            fmt = read_chat_format(tok, model.generation_config)
            self.loads += 1
            self.load_seconds += time.perf_counter() - started
            self.log(f"target loaded in {time.perf_counter() - started:.1f}s (target loads in this job: {self.loads})")
            self._opened = (model, tok, dev, fmt)
        return self._opened

    def close(self) -> None:
        self._opened = None

    def __enter__(self) -> GenerationSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@torch.no_grad()
def generate_into(
    session: GenerationSession,
    prompts_path: Path,
    out_path: Path,
    sampling: Sampling,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate one response per prompt of one shard with the session's target; write the shard atomically.

    Sampling is seeded per batch from ``seed`` and the batch's offset in the shard alone, so a shard's bytes
    do not depend on the shards generated before it in the same job."""
    prompts = read_prompts(prompts_path)
    model, tok, dev, fmt = session.open()
    target_path = session.target_path
    eos_ids = list(fmt.stop_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    temperature, top_p, max_new_tokens = sampling.temperature, sampling.top_p, sampling.max_new_tokens
    batch_size, seed = sampling.batch_size, sampling.seed
    params = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed}
    phash = params_hash(str(target_path), params)

    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        prompt_ids = [render_prompt_ids(tok, p["messages"], tools=p.get("tools")) for p in batch]
        width = max(len(ids) for ids in prompt_ids)
        # Left padding: every row's last prompt token sits at the same column, so generation is batched.
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        # Seeded per batch so a re-run of one shard reproduces its samples.
        torch.manual_seed(seed * 1_000_003 + b)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask.to(dev),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p if temperature > 0 else None,
            top_k=None,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
        )
        elapsed = time.perf_counter() - t0
        for i, p in enumerate(batch):
            gen = out[i, width:].tolist()
            # Keep the exact sampled ids up to and including the first end-of-turn token.
            end = next((j for j, t in enumerate(gen) if t in eos_ids), None)
            output_ids = gen[: end + 1] if end is not None else gen
            records.append(
                {
                    "format": RESPONSES_FORMAT,
                    "id": p["id"],
                    "dataset": p["dataset"],
                    "messages": p["messages"],
                    **({"tools": p["tools"]} if p.get("tools") else {}),
                    "backend": IN_PROCESS,
                    "model": str(target_path),
                    "params": params,
                    "params_hash": phash,
                    **split_generated(tok, output_ids, fmt),
                    "prompt_token_ids": prompt_ids[i],
                    "output_token_ids": output_ids,
                    "usage": {"prompt_tokens": len(prompt_ids[i]), "completion_tokens": len(output_ids)},
                    "latency_s": round(elapsed / len(batch), 4),
                }
            )
        done = b + len(batch)
        so_far = time.perf_counter() - started
        tokens = sum(r["usage"]["completion_tokens"] for r in records)
        eta = so_far / done * (len(prompts) - done)
        log(
            f"{out_path.name}: {done}/{len(prompts)} prompts, {tokens / so_far:.0f} tok/s, "
            f"{done / so_far * 60:.1f} prompts/min, ETA {eta:.0f}s ({elapsed:.1f}s for this batch)"
        )

    write_jsonl(out_path, records)
    completion = sum(r["usage"]["completion_tokens"] for r in records)
    truncated = sum(r["finish_reason"] == "length" for r in records)
    no_reasoning = sum(r["reasoning"] is None for r in records)
    summary = {
        "samples": len(records),
        "completion_tokens": completion,
        "truncated": truncated,
        "without_reasoning": no_reasoning,
        "seconds": round(time.perf_counter() - started, 2),
    }
    log(f"{out_path.name}: {json.dumps(summary)}")
    return summary


def generate_hf(
    prompts_path: Path,
    out_path: Path,
    target_path: str,
    sampling: Sampling,
    *,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate one shard with a target loaded for it alone (one load per call; the pipeline's rule
    ``responses_hf`` uses ``generate_hf_shards``, one load for all shards)."""
    set_threads(threads)
    with GenerationSession(target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code, log=log) as s:
        return generate_into(s, prompts_path, out_path, sampling, log=log)


# ----------------------------------------------------------------------------------------------------------
# the in-process responses job: every shard of a run with one target load (aerie.target_model.store)


GENERATION_STAGE = StoreStage(
    store_dir=GENERATION_STORE_DIR,
    produced="generated",
    seconds="generate_seconds",
    reused="reused from the generation store ({store}: same prompts, target and settings), nothing generated",
    producing="generating from {task.prompts}",
    stopped=(
        "generation stopped at {out} ({n} of {shards}): {generated} generated and {reused} reused before it stay "
        "in the generation store for the next attempt"
    ),
    summary=(
        "aerie responses: {shards} in-process shards, {generated} generated, {reused} reused from the generation "
        "store; target loads in this job: {target_loads} ({load_seconds}s loading, {generate_seconds}s generating)"
    ),
)


@dataclass(frozen=True)
class ResponsesTask:
    """One shard of the in-process responses job: its dataset's sampling, its prompts shard, its declared output
    and its own log file."""

    prompts: Path
    out: Path
    settings: Sampling
    log: Path | None = None


def generate_hf_shards(
    shards: Sequence[ResponsesTask],
    target_path: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate every shard with at most one target load; each shard keeps its own file and log.

    The store job (aerie.target_model.store.run_store_job) generates a shard into the generation store, records
    its key beside it and hard-links it to its output. A store entry whose record carries the shard's
    generation key - same prompts bytes, target and settings - and whose bytes are the recorded ones is
    reused without any work; so a rerun after a crash or a failed shard generates only what is missing, and
    loads the target only if something is. The first shard that fails stops the job: the shards finished
    before it stay in the store."""
    set_threads(threads)
    target = target_identity(target_path)

    def key_of(task: ResponsesTask) -> str:
        p = task.settings
        settings = generation_settings(
            model=target_path,
            temperature=p.temperature,
            top_p=p.top_p,
            max_new_tokens=p.max_new_tokens,
            batch_size=p.batch_size,
            seed=p.seed,
            device=device,
            dtype=dtype,
        )
        return generation_key(file_sha256(task.prompts), target, settings)

    def reuse(task: ResponsesTask, store: Path, key: str) -> bool:
        return stored_generation(store, key) is not None

    def produce(task: ResponsesTask, store: Path, key: str, shard_log: Callable[[str], None]) -> float:
        # As configured (not the key's normalised values): the records carry them as they are.
        summary = generate_into(session, task.prompts, store, task.settings, log=shard_log)
        # After the entry: a job killed between the two leaves an entry without a record, generated again.
        write_generation_record(store, key, summary)
        return summary["seconds"]

    with GenerationSession(
        target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code, log=log
    ) as session:
        return run_store_job(
            shards, GENERATION_STAGE, key=key_of, reuse=reuse, produce=produce, session=session, log=log
        )


def generate_hf_job(
    prompts: Sequence[str | Path],
    outputs: Sequence[str | Path],
    shard_logs: Sequence[str | Path],
    datasets: Sequence[str],
    sampling: Mapping[str, Sampling],
    target: Mapping[str, Any],
    *,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Rule ``responses_hf``: ``generate_hf_shards`` over the rule's shards, the i-th prompts shard answered into
    the i-th output with the sampling of its dataset (``sampling[datasets[i]]``, resolved by the plan) and the
    ``target`` section of the config."""
    if not len(prompts) == len(outputs) == len(shard_logs) == len(datasets):
        raise SystemExit(
            f"rule responses_hf: {len(prompts)} prompts shards, {len(outputs)} outputs, {len(shard_logs)} shard "
            f"logs and {len(datasets)} datasets: the rule must list one of each per shard"
        )
    tasks = [
        ResponsesTask(Path(p), Path(o), sampling[d], Path(lg))
        for p, o, lg, d in zip(prompts, outputs, shard_logs, datasets)
    ]
    return generate_hf_shards(
        tasks,
        target["path"],
        device=target["device"],
        dtype=target["dtype"],
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        threads=threads,
        log=log,
    )
