"""Talking to a running SGLang server: ``/generate`` requests, ``/server_info``, ``/flush_cache``.

Facts from SGLang 0.5.23 (the version envs/sglang.yaml pins): ``/generate``'s ``meta_info`` carries
``completion_tokens``, ``e2e_latency`` and, only on speculative servers once a verify step ran,
``spec_verify_ct``; ``/server_info`` (``/get_server_info`` is its deprecated alias; older servers only have
the latter) returns every resolved server argument (``--api-key`` included: only :data:`SERVER_INFO_FIELDS`
are kept), the scheduler's info and ``internal_states``, one per DP rank, whose ``avg_spec_accept_length``
is described in :mod:`aerie.benchmark.sglang_stats`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from aerie.benchmark.sglang_stats import first_difference, mode_stats
from aerie.sources.datasets import PromptSet

# The /server_info fields worth keeping (it also returns every server argument, --api-key included).
# 0.5.23 sizes decode and prefill CUDA graphs separately (cuda_graph_max_bs_decode / _prefill);
# cuda_graph_max_bs is the single setting of older servers.
SERVER_INFO_FIELDS = (
    "version",
    "model_path",
    "tp_size",
    "dp_size",
    "mem_fraction_static",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_window_size",  # DFLASH with sliding draft layers
    "speculative_draft_attention_backend",
    "max_running_requests",
    "cuda_graph_max_bs_decode",
    "cuda_graph_max_bs_prefill",
    "cuda_graph_max_bs",
    "disable_cuda_graph",
    "disable_radix_cache",
    "max_total_num_tokens",
    "max_req_input_len",
    "attention_backend",
    "dtype",
    "kv_cache_dtype",
    "decode_log_interval",
)


def parse_generate_response(body: Any) -> dict[str, Any]:
    """The fields the benchmark keeps from one ``/generate`` response body (``error`` set on failure)."""
    if not isinstance(body, dict):
        return {"error": f"response is not a JSON object: {str(body)[:200]}"}
    if body.get("error"):
        return {"error": f"server error: {str(body['error'])[:300]}"}
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        return {"error": "response has no meta_info"}
    ids = body.get("output_ids")
    ids = [int(i) for i in ids] if isinstance(ids, list) else None
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    completion = meta.get("completion_tokens")
    if completion is None and ids is not None:
        completion = len(ids)
    verify = meta.get("spec_verify_ct")
    rec = {
        "server_id": meta.get("id"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": completion,
        "cached_tokens": meta.get("cached_tokens"),
        "e2e_latency_s": meta.get("e2e_latency"),
        "spec_verify_ct": verify,
        "spec_accept_length": completion / verify if completion is not None and verify else None,
        # [j]: verify steps that accepted j drafts (bonus token not counted); acceptance per draft position
        "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram"),
        "finish_reason": kind,
        "output_ids": ids,
        "text": body.get("text"),
        "error": None,
    }
    if kind == "abort":
        msg = finish.get("message") if isinstance(finish, dict) else None
        rec["error"] = f"request aborted by the server: {msg}"
    elif completion is None:
        rec["error"] = "response has neither completion_tokens nor output_ids"
    return rec


def parse_server_info(body: Any) -> dict[str, Any]:
    """``{avg_spec_accept_length, avg_spec_accept_length_per_dp, fields}`` from a /server_info body.

    0.5.x: ``internal_states`` is a list (one per DP rank) whose items may hold ``avg_spec_accept_length``
    (absent on a baseline server and before the first verify step); older servers put it at the top
    level, and a PD router under ``decode[0]``. Only :data:`SERVER_INFO_FIELDS` are kept.
    """
    body = body if isinstance(body, dict) else {}
    per_dp: list[float] = []
    states = body.get("internal_states")
    if isinstance(states, list):
        per_dp = [
            float(s["avg_spec_accept_length"])
            for s in states
            if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), (int, float))
        ]
    value: float | None = statistics.fmean(per_dp) if per_dp else None
    if value is None and isinstance(body.get("avg_spec_accept_length"), (int, float)):
        value = float(body["avg_spec_accept_length"])
    decode = body.get("decode")
    if value is None and isinstance(decode, list) and decode and isinstance(decode[0], dict):
        v = decode[0].get("avg_spec_accept_length")
        value = float(v) if isinstance(v, (int, float)) else None
    fields = {
        k: body[k]
        for k in SERVER_INFO_FIELDS
        if k in body and (body[k] is None or isinstance(body[k], (str, int, float, bool)))
    }
    return {"avg_spec_accept_length": value, "avg_spec_accept_length_per_dp": per_dp, "fields": fields}


# ---- the client ---------------------------------------------------------------------------------------


@dataclass
class SGLangClient:
    """The benchmark's requests to one server: greedy ``/generate`` with ``input_ids`` or ``text``."""

    base: str
    max_new_tokens: int
    input_key: str
    timeout_s: float
    headers: dict[str, str] = field(default_factory=dict)
    admin_headers: dict[str, str] = field(default_factory=dict)
    info_endpoint: str | None = None

    def body(self, prompt_input: list[int] | str, max_new_tokens: int | None = None) -> dict[str, Any]:
        return {
            self.input_key: prompt_input,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_new_tokens or self.max_new_tokens,
                "skip_special_tokens": False,
            },
        }

    async def generate(self, session, pid: str, prompt_input, max_new_tokens: int | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            async with session.post(
                self.base + "/generate", json=self.body(prompt_input, max_new_tokens), headers=self.headers
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as e:
            return {"id": pid, "latency_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
        latency = time.perf_counter() - t0
        if status != 200:
            return {"id": pid, "latency_s": latency, "error": f"HTTP {status}: {raw[:300].decode(errors='replace')}"}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return {"id": pid, "latency_s": latency, "error": f"invalid JSON: {raw[:200].decode(errors='replace')}"}
        return {"id": pid, "latency_s": latency, **parse_generate_response(body)}

    async def top2_gap(self, session, input_ids: list[int]) -> float | None:
        """The target's top-1 minus top-2 logprob for the token after ``input_ids`` (None when unreadable).

        One greedy token with ``return_logprob`` and ``top_logprobs_num: 2``: for an all-greedy batch SGLang 0.5.23
        takes logprobs as log_softmax of the raw logits (layers/sampler.py), so this is the top-2 logit gap; the
        answer's ``meta_info.output_top_logprobs[0]`` is ``[[logprob, token_id, text], ...]``, best first
        (tests/fixtures/sglang/generate_logprobs.json). The first token comes from prefill: no speculation."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "skip_special_tokens": False},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        try:
            async with session.post(self.base + "/generate", json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    return None
                meta = json.loads(await resp.read()).get("meta_info") or {}
            top = (meta.get("output_top_logprobs") or [None])[0] or []
            return float(top[0][0]) - float(top[1][0]) if len(top) >= 2 else None
        except Exception:  # noqa: BLE001 - an unreadable margin counts as a loss in the gate, never as a tie
            return None

    async def run_set(self, session, inputs: Sequence[tuple[str, Any]], concurrency: int) -> tuple[list[dict], float]:
        sem = asyncio.Semaphore(concurrency)

        async def one(pid, prompt_input):
            async with sem:
                return await self.generate(session, pid, prompt_input)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(pid, x) for pid, x in inputs))
        return list(records), time.perf_counter() - t0

    async def server_info(self, session) -> dict[str, Any] | None:
        """``/server_info`` (0.5.x), falling back to ``/get_server_info`` (older servers); None if neither answers."""
        endpoints = [self.info_endpoint] if self.info_endpoint else ["/server_info", "/get_server_info"]
        for ep in endpoints:
            try:
                async with session.get(self.base + ep, headers=self.headers) as resp:
                    if resp.status != 200:
                        continue
                    body = json.loads(await resp.read())
            except Exception:  # noqa: BLE001 - the reading is optional; the benchmark goes on without it
                continue
            self.info_endpoint = ep
            return parse_server_info(body)
        return None

    async def flush_cache(self, session) -> bool:
        """``POST /flush_cache`` (an admin endpoint: the admin key when the server has one, else the API key)."""
        try:
            async with session.post(self.base + "/flush_cache", headers=self.admin_headers) as resp:
                await resp.read()
                return resp.status == 200
        except Exception:  # noqa: BLE001
            return False


async def probe_divergences(
    client: SGLangClient,
    session,
    records: Sequence[dict[str, Any]],
    baseline: Sequence[dict[str, Any]],
    inputs: Mapping[str, Any],
) -> dict[str, float | None]:
    """For each output that differs from the baseline's (same prompt), the target's top-2 logit gap at the first
    differing token, read from this server (prompt ids + the baseline's output before it). ``{prompt id: gap}``;
    None where it cannot be read (text input, no ids, or the server did not answer)."""
    base = {r["id"]: r for r in baseline if not r.get("error")}
    gaps: dict[str, float | None] = {}
    for r in records:
        b = base.get(r["id"])
        if r.get("error") or b is None or r.get("output_ids") is None or b.get("output_ids") is None:
            continue
        d = first_difference(b["output_ids"], r["output_ids"])
        if d is None:
            continue
        prompt = inputs.get(r["id"])
        ok = isinstance(prompt, list) and d < len(b["output_ids"])
        gaps[r["id"]] = await client.top2_gap(session, prompt + b["output_ids"][:d]) if ok else None
    return gaps


async def drive_server(
    client: SGLangClient,
    prompt_sets: Sequence[PromptSet],
    inputs: Mapping[str, list[tuple[str, Any]]],
    concurrency: Sequence[int],
    warmup: int,
    flush_cache: bool,
    mode: str,
    log: Callable[[str], None],
    baseline_runs: Mapping[tuple[str, int], dict[str, Any]] | None = None,
) -> tuple[dict[tuple[str, int], dict[str, Any]], dict | None]:
    """Warm the server up, then run every prompt set at every concurrency level, each after a cache flush.

    With ``baseline_runs`` (a speculative server), once every timed run is done, each output that differs from the
    baseline's is probed for the target's margin there (:func:`probe_divergences`), untimed.
    Returns ``runs[(set, concurrency)] = {records, wall_s, cache_flushed, server_avg_spec_accept_length,
    logit_gaps}`` and the last ``/server_info`` reading (:func:`parse_server_info`)."""
    timeout = aiohttp.ClientTimeout(total=client.timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max(concurrency) + 4)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    info = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        first = next(x for ps in prompt_sets for x in inputs[ps.name][:1])
        for i in range(warmup):
            rec = await client.generate(session, f"warmup-{i}", first[1], min(client.max_new_tokens, 32))
            if rec.get("error"):
                raise RuntimeError(f"{mode} server: warm-up request failed: {rec['error']}")
        for ps in prompt_sets:
            for c in concurrency:
                flushed = await client.flush_cache(session) if flush_cache else False
                if flush_cache and not flushed:
                    log(f"{mode}: /flush_cache did not succeed before {ps.name} @ {c}; prefix cache may carry over")
                records, wall = await client.run_set(session, inputs[ps.name], c)
                got = await client.server_info(session)
                info = got or info
                avg = got["avg_spec_accept_length"] if got else None
                runs[(ps.name, c)] = {
                    "records": records,
                    "wall_s": wall,
                    "cache_flushed": flushed,
                    "server_avg_spec_accept_length": avg,
                }
                stats = mode_stats(records, wall, avg, cache_flushed=flushed)
                al, sal = stats["acceptance_length"], stats["spec_accept_length"]
                server = f"{avg:.2f}" if avg is not None else "n/a"
                log(
                    f"{mode} {ps.name} @ concurrency {c}: {stats['ok']}/{stats['requests']} ok"
                    + (f" ({stats['failed']} FAILED)" if stats["failed"] else "")
                    + f", {stats['output_tokens_per_s'] or 0:.1f} tok/s"
                    + (
                        f", acceptance_length {al:.2f} (aerie's), spec_accept_length {sal:.2f} (SGLang's), server "
                        f"counter {server}"
                        if al is not None
                        else ""
                    )
                )
        for key, run in runs.items():
            base = (baseline_runs or {}).get(key)
            if base is not None:
                run["logit_gaps"] = await probe_divergences(
                    client, session, run["records"], base["records"], dict(inputs[key[0]])
                )
                if run["logit_gaps"]:
                    log(
                        f"{mode} {key[0]} @ concurrency {key[1]}: outputs differing from the baseline's, top-2 "
                        f"logit gap at the first difference: {run['logit_gaps']}"
                    )
    return runs, info
