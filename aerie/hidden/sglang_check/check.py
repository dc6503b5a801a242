"""The GPU-host check of the SGLang capture: SGLang's captured states against transformers on the same model.

``aerie-sglang-capture check`` (:mod:`aerie.hidden.sglang_check.cli`) runs it on a random-weight target written by
:func:`make_tiny_target` or any model transformers can also load on one GPU in fp32.

``make-tiny kimi`` is Kimi K2.5's own path at toy size: the rehearsal target's wrapper
(``KimiK25ForConditionalGeneration`` with a DeepseekV3 ``text_config``, weights under ``language_model.``, its
modeling and tiktoken tokenizer code loaded with ``trust_remote_code``, Kimi's 163,840-id vocabulary and special
ids) around a random DeepseekV3 with the MLA head dims SGLang's GPU kernels take (the built rehearsal target's
toy dims are below them). SGLang 0.5.23 serves that wrapper with its own ``models/kimi_k25.py``: it builds a
MoonViT vision tower from ``vision_config`` and loads the language weights with the ``language_model.`` prefix
stripped into its ``DeepseekV3ForCausalLM``, whose ``set_eagle3_layers_to_capture`` the wrapper forwards to.
The folder carries no vision weights (text capture never runs the tower; the rehearsal's toy tower has other
parameter names than MoonViT's); ``vision_config`` gives both classes a small tower they can build.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

from aerie.hidden.head import lm_head_topk
from aerie.target_model.capture import base_decoder
from aerie.targets.rehearsal import remote_code
from aerie.targets.rehearsal.chat_template import DEFAULT_SYSTEM_PROMPT
from aerie.targets.rehearsal.config import VOCAB_SIZE
from aerie.targets.rehearsal.remote_code.configuration_kimi_k25 import KimiK25Config
from aerie.targets.rehearsal.remote_code.modeling_kimi_k25 import KimiK25ForConditionalGeneration
from aerie.targets.rehearsal.tokenizer import KIMI_SPECIAL_TOKEN_IDS, train_bpe_ranks, write_tokenizer

TINY_KINDS = ("llama", "deepseek", "kimi")
# A vision tower both SGLang's KimiK25VisionConfig / MoonViT (num_attention_heads, merge_kernel_size, vt_* names)
# and the rehearsal's remote code (in_channels, patch_size, hidden_size) can build; 4 heads: TP up to 4.
TINY_KIMI_VISION = {
    "in_channels": 3,
    "patch_size": 14,
    "hidden_size": 64,
    "vt_hidden_size": 64,
    "num_attention_heads": 4,
    "vt_num_attention_heads": 4,
    "num_hidden_layers": 1,
    "vt_num_hidden_layers": 1,
    "intermediate_size": 128,
    "vt_intermediate_size": 128,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "init_pos_emb_time": 4,
    "merge_kernel_size": [2, 2],
    "mm_hidden_size": 64,
}


def _tiny_config(kind: str, **overrides: Any) -> Any:
    """Small random targets SGLang's GPU kernels accept (MLA needs Kimi's real head dims); ``overrides`` replace
    the (text) config's arguments (tests shrink them further for CPU); derived fields follow them."""
    cls, kwargs = (LlamaConfig, dict(TINY_LLAMA)) if kind == "llama" else (DeepseekV3Config, dict(TINY_DEEPSEEK))
    if kind == "kimi":
        ids = KIMI_SPECIAL_TOKEN_IDS
        kwargs.update(
            vocab_size=VOCAB_SIZE, bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"]
        )
    elif kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny target {kind!r} ({', '.join(TINY_KINDS)})")
    unknown = sorted(set(overrides) - set(cls().to_dict()))
    if unknown:
        raise ValueError(f"tiny {kind} target: its config has no {unknown}")
    return cls(**{**kwargs, **overrides})


TINY_LLAMA = dict(
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
TINY_DEEPSEEK = dict(
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


def make_tiny_target(kind: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight target folder in bf16 (for ``check`` on a GPU host without a real model); ``kind`` one of
    TINY_KINDS, ``overrides`` fields of its (text) config."""
    config = _tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    if kind == "kimi":
        model = _kimi_wrapper(config)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # larger than the default init: states differ clearly from layer to layer
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind != "kimi":
        model.save_pretrained(out_dir, safe_serialization=True)
        return out_dir
    text_only = {k: v for k, v in model.state_dict().items() if k.startswith("language_model.")}
    model.save_pretrained(out_dir, state_dict=text_only, safe_serialization=True)
    _write_kimi_code_and_tokenizer(out_dir, config.max_position_embeddings)
    return out_dir


def _kimi_wrapper(text: Any) -> torch.nn.Module:
    """Kimi K2.5's wrapper (the rehearsal target's remote code) around a fresh DeepseekV3 of config ``text``."""
    config = KimiK25Config(
        text_config=text.to_dict(),
        vision_config={**TINY_KIMI_VISION, "text_hidden_size": text.hidden_size},
        media_placeholder_token_id=KIMI_SPECIAL_TOKEN_IDS["<|media_pad|>"],
        architectures=["KimiK25ForConditionalGeneration"],
        auto_map={
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
    )
    return KimiK25ForConditionalGeneration(config).to(torch.bfloat16)


def _write_kimi_code_and_tokenizer(out_dir: Path, max_length: int) -> None:
    """The wrapper's modeling code and Kimi's tiktoken tokenizer class (the rehearsal target's), as Kimi K2.5 ships
    them: the folder loads only with trust_remote_code."""
    for name in ("configuration_kimi_k25.py", "modeling_kimi_k25.py"):
        shutil.copyfile(Path(remote_code.__file__).parent / name, out_dir / name)
    texts = [DEFAULT_SYSTEM_PROMPT, "def f(x):\n    return x + 1\n", "Sort [3, 1, 2]. The answer is 6."] * 20
    write_tokenizer(out_dir, train_bpe_ranks(texts, 300), model_max_length=max_length)


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
    lm_head_copy: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Per aux id: which transformers hidden state SGLang's tensor is closest to (must be index id + 1) and
    how close; the same for the final state, plus greedy next-token agreement through lm_head. With
    ``lm_head_copy`` (the capture's copy of the head, where the capture keeps it) also the agreement of the
    top-1 of its top-k targets (aerie.hidden.head.lm_head_topk) with transformers' greedy tokens."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    dev = next(model.parameters()).device
    H = model.config.get_text_config().hidden_size
    per_id: dict[int, dict[str, Any]] = {i: {"errors": {}} for i in layer_ids}
    final_err, agree, copy_agree, total = [], 0, 0, 0
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
        if lm_head_copy is not None:
            copy_agree += int((lm_head_topk(final, lm_head_copy, 1)[0][:, 0] == pred).sum())
        total += len(pred)
    ok = True
    for i, row in per_id.items():
        row["errors"] = {k: max(v) for k, v in row["errors"].items()}
        row["closest_hidden_states_index"] = min(row["errors"], key=row["errors"].get)
        row["ok"] = row["closest_hidden_states_index"] == i + 1 and row["errors"][i + 1] < 0.05
        ok &= row["ok"]
    report = {"aux": per_id, "final_rel_err": max(final_err), "argmax_agreement": agree / total}
    report["ok"] = ok and report["final_rel_err"] < 0.05 and report["argmax_agreement"] > 0.9
    if lm_head_copy is not None:
        report["lm_head_copy_argmax_agreement"] = copy_agree / total
        report["ok"] = report["ok"] and report["lm_head_copy_argmax_agreement"] > 0.9
    return report
