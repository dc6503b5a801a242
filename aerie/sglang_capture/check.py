"""The GPU-host check of the SGLang capture: SGLang's captured states against transformers on the same model.

``aerie-sglang-capture check`` (:mod:`aerie.sglang_capture.cli`) runs it on a random-weight target written by
:func:`make_tiny_target` or any model transformers can also load on one GPU in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aerie.capture import base_decoder


def _tiny_config(kind: str) -> Any:
    """Small random targets SGLang's GPU kernels accept (MLA needs Kimi's real head dims)."""
    from transformers import DeepseekV3Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
    if kind == "deepseek":
        return DeepseekV3Config(
            vocab_size=4096,
            hidden_size=1024,
            intermediate_size=2048,
            moe_intermediate_size=256,
            num_hidden_layers=8,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            architectures=["DeepseekV3ForCausalLM"],
        )
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
def compare_with_transformers(
    target: Path,
    layer_ids: list[int],
    captured: list[tuple[torch.Tensor, torch.Tensor]],
    seqs: list[torch.Tensor],
    *,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
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
        ref_final = base_decoder(model)(ids[None].to(dev)).last_hidden_state[0].cpu()
        for j, i in enumerate(layer_ids):
            got = aux[:, j * H : (j + 1) * H]
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
