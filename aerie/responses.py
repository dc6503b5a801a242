"""Stage 2: prompts -> target responses (format ``aerie.responses/1``).

Backends share one record format. This module holds the in-process ``hf`` backend: the target
generates with transformers, so the exact sampled ids are kept. API backends (OpenRouter, any
OpenAI-compatible server, SGLang ``/generate``) write the same records without or with ids.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aerie.artifacts import write_jsonl
from aerie.formats.responses import RESPONSES_FORMAT
from aerie.prompts import read_prompts
from aerie.target.chat import ChatFormat, read_chat_format, render_prompt_ids
from aerie.target.model import load_target, set_threads


def params_hash(model: str, params: dict[str, Any]) -> str:
    """Short stable hash of what determines a response: a changed parameter never reuses old work."""
    blob = json.dumps({"model": model, "params": params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def split_generated(tokenizer, output_ids: list[int], fmt: ChatFormat) -> dict[str, Any]:
    """Split exact output ids into reasoning / content text and the finish reason.

    The sampled sequence is ``[<think>] reasoning </think> content <turn end>`` (``<think>`` only when the
    prompt did not open the block itself, as with Kimi-K2-Thinking's template).
    """
    finish_reason = "stop" if output_ids and output_ids[-1] in fmt.stop_ids else "length"
    body = output_ids[:-1] if finish_reason == "stop" else output_ids
    if fmt.think_end_id is not None and fmt.think_end_id in body:
        cut = body.index(fmt.think_end_id)
        reasoning_ids, content_ids = body[:cut], body[cut + 1 :]
        if reasoning_ids[:1] == [fmt.think_start_id]:
            reasoning_ids = reasoning_ids[1:]
        reasoning = tokenizer.decode(reasoning_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    else:
        reasoning, content_ids = None, body
    # skip_special_tokens=False: tool-call markers are special tokens and must survive as text.
    content = tokenizer.decode(content_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return {"reasoning": reasoning, "content": content, "finish_reason": finish_reason}


@torch.no_grad()
def generate_hf(
    prompts_path: Path,
    out_path: Path,
    target_path: str,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate one response per prompt in-process with the target; write the shard atomically."""
    set_threads(threads)
    prompts = read_prompts(prompts_path)
    model, tok, dev = load_target(target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    fmt = read_chat_format(tok, model.generation_config)
    eos_ids = list(fmt.stop_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
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
                    "backend": "hf",
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
        log(f"{out_path.name}: {done}/{len(prompts)} prompts, {elapsed:.1f}s for this batch")

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
