"""The target's lm_head as the capture uses it: the compact layout's top-k targets, and the SGLang capture's copy.

The ``hf`` backend computes the top-k with the loaded model's own head. SGLang keeps its vocab-parallel head to
itself, so the ``sglang`` backend reads ``lm_head.weight`` from the target's safetensors and keeps a copy where
:func:`aerie.hidden.sglang.mapping.lm_head_copy` says (SGLang's rank-0 GPU by default), placed - with the top-k
workspace already allocated - before SGLang's workers start, so that SGLang sizes its KV pool around it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aerie.hidden.sglang.mapping import TOPK_CHUNK_ELEMENTS, HeadCopy
from aerie.target_model.heads import read_target_heads


def lm_head_topk(
    final: torch.Tensor, lm_head: torch.Tensor, k: int, max_elements: int = TOPK_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] final states -> (ids int64 [n, k], log-probs fp32 [n, k]) of the target's top-k next tokens.

    Logits are computed in fp32 on lm_head's device, in row chunks (and, for a bf16 head, vocab chunks) so no
    temporary exceeds ``max_elements`` floats and at most four are alive at once (TOPK_LIVE_TEMPORARIES): Kimi's
    [163840, 7168] head is never copied whole to fp32. The log-probabilities are normalised over the full
    vocabulary, so their exp sums to the top-k mass."""
    V, H = lm_head.shape
    rows = max(1, max_elements // V)
    vocab_chunk = V if lm_head.dtype == torch.float32 else max(1, max_elements // H)
    ids_out, lp_out = [torch.zeros(0, k, dtype=torch.long)], [torch.zeros(0, k)]
    for r in range(0, len(final), rows):
        x = final[r : r + rows].to(lm_head.device, torch.float32)
        logits = torch.cat([x @ lm_head[v : v + vocab_chunk].float().T for v in range(0, V, vocab_chunk)], -1)
        top = logits.topk(k, dim=-1)  # sorted by logit, descending
        lp_out.append((top.values - logits.logsumexp(-1, keepdim=True)).cpu())
        ids_out.append(top.indices.cpu())
        del logits, top  # before the next block's logits exist: the workspace holds one block's
    return torch.cat(ids_out), torch.cat(lp_out)


def place_lm_head(
    target_path: str | Path, copy: HeadCopy, log: Callable[[str], None] = print
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Read the target's lm_head [V, H] (as stored) onto ``copy.device`` and, on a GPU, allocate the top-k workspace
    there at once (one top-k pass over two row blocks of zeros; the caching allocator keeps the blocks), so that
    memory is in use before SGLang measures what it may take. Returns the head and what it holds, measured."""
    head = read_target_heads(target_path, roles=["lm_head"]).lm_head
    V, H = head.shape
    if (V, H) != (copy.vocab_size, copy.hidden_size):
        raise ValueError(
            f"{target_path}: lm_head is [{V}, {H}], its config.json says [{copy.vocab_size}, {copy.hidden_size}]"
        )
    device = torch.device(copy.device)
    head = head.to(device)
    facts: dict[str, Any] = {
        "device": str(device),
        "shape": [V, H],
        "dtype": str(head.dtype).removeprefix("torch."),
        "weight_bytes": head.numel() * head.element_size(),
        "workspace_bytes_bound": copy.workspace_bytes,
        "plan": copy.describe(),  # what the fit plan counts (aerie.hidden.sglang.lm_head_copy)
    }
    if device.type == "cuda":
        rows = max(1, TOPK_CHUNK_ELEMENTS // V)
        lm_head_topk(torch.zeros(2 * rows, H), head, 1)
        torch.cuda.synchronize(device)
        facts["reserved_bytes"] = int(torch.cuda.memory_reserved(device))  # head + workspace, as SGLang will see it
    log(
        f"lm_head copy for the top-k targets: [{V}, {H}] {facts['dtype']} = {facts['weight_bytes'] / 1e9:.2f} GB on "
        f"{device}"
        + (
            f", {facts['reserved_bytes'] / 1e9:.2f} GB reserved with the top-k workspace"
            if "reserved_bytes" in facts
            else ""
        )
        + " (placed before SGLang sizes its memory pools)"
    )
    return head, facts
