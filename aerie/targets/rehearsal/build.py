"""Build the Kimi-shaped rehearsal target folder, published atomically.

    python -m aerie.targets.rehearsal.build OUT_DIR [--steps N] [--threads N]

A tiny DeepseekV3 (MLA attention, MoE with a dense first layer, yarn rope) inside Kimi K2.5's multimodal
wrapper, with Kimi's tiktoken tokenizer class, special ids and vocabulary size, pre-trained for a few CPU
minutes on the demo's task language with the demo's training loop and evaluation
(``aerie.targets.demo.pretrain``). Loading it takes ``trust_remote_code=True``, as Kimi K2.5 does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, GenerationConfig

from aerie.target_model.capture import base_decoder
from aerie.targets.demo.build import parse_build_args, publish_target, report_opening
from aerie.targets.demo.pretrain import TOKENIZER_SEED_OFFSET, evaluate, pretrain
from aerie.targets.demo.tokenizer import SYSTEM_PROMPTS, special_token_ids, tokenizer_corpus
from aerie.targets.rehearsal import remote_code
from aerie.targets.rehearsal.chat_template import DEFAULT_SYSTEM_PROMPT
from aerie.targets.rehearsal.config import RehearsalTargetConfig
from aerie.targets.rehearsal.remote_code.configuration_kimi_k25 import KimiK25Config
from aerie.targets.rehearsal.remote_code.modeling_kimi_k25 import KimiK25ForConditionalGeneration
from aerie.targets.rehearsal.tokenizer import (
    KIMI_SPECIAL_TOKEN_IDS,
    SPECIAL_TOKENS_START,
    VOCAB_SIZE,
    train_bpe_ranks,
    write_tokenizer,
)

REPORT_FILE = "aerie_rehearsal_target.json"
REPORT_FORMAT = "aerie.rehearsal-target/1"
REMOTE_MODEL_FILES = ("configuration_kimi_k25.py", "modeling_kimi_k25.py")


def text_config(cfg: RehearsalTargetConfig) -> DeepseekV3Config:
    ids = KIMI_SPECIAL_TOKEN_IDS
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        first_k_dense_replace=cfg.first_k_dense_replace,
        n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=cfg.routed_scaling_factor,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids["[EOS]"],
        pad_token_id=ids["[PAD]"],
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
    )


def build_model(cfg: RehearsalTargetConfig, live_ids: Sequence[int]) -> KimiK25ForConditionalGeneration:
    """The wrapper with a freshly initialised language model; lm_head rows of ids the tokenizer never
    produces are zero (see ``LiveVocabLoss``)."""
    config = KimiK25Config(
        text_config=text_config(cfg).to_dict(),
        vision_config={"in_channels": 3, "patch_size": 14, "hidden_size": cfg.vision_hidden_size},
        media_placeholder_token_id=KIMI_SPECIAL_TOKEN_IDS["<|media_pad|>"],
        architectures=["KimiK25ForConditionalGeneration"],
        auto_map={
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
    )
    torch.manual_seed(cfg.seed)
    model = KimiK25ForConditionalGeneration(config)
    head = model.get_output_embeddings().weight
    dead = torch.ones(head.shape[0], dtype=torch.bool)
    dead[torch.tensor(sorted(live_ids))] = False
    with torch.no_grad():
        head[dead] = 0.0
    return model


class LiveVocabLoss:
    """Exact full-vocabulary completion cross-entropy for a head whose rows outside ``live_ids`` are zero.

    Those ids' logits are exactly 0 for every input, so the log-partition over all 163,840 ids is
    ``logsumexp(live logits, log(#dead))``: the same loss as ``completion_loss`` (and the same model at
    inference), at the cost of the live vocabulary only.

    Inside ``with loss.compact(model):`` the embedding and head hold only the live rows (ids are mapped to
    their rank among the live ids), so the optimiser, the clipping and the embedding gradient also cost the
    live vocabulary only - AdamW over the full 163,840-row matrices measured slower than the whole forward and
    backward pass. Leaving the block writes the trained rows back; dead head rows stay exactly 0.
    """

    def __init__(self, live_ids: Sequence[int], vocab_size: int):
        self.live = torch.tensor(sorted(set(live_ids)), dtype=torch.long)
        self.position = torch.full((vocab_size,), -1, dtype=torch.long)
        self.position[self.live] = torch.arange(len(self.live))
        self.log_dead = math.log(vocab_size - len(self.live))
        self.is_compact = False

    @contextlib.contextmanager
    def compact(self, model: torch.nn.Module) -> Iterator[None]:
        """Swap the embedding and head for their live rows while the block runs (training)."""
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        full_embed, full_head, padding_idx = embed.weight, head.weight, embed.padding_idx
        embed.weight = torch.nn.Parameter(full_embed.detach()[self.live].clone())
        head.weight = torch.nn.Parameter(full_head.detach()[self.live].clone())
        if padding_idx is not None:  # [PAD] is live: its row keeps getting no gradient
            embed.padding_idx = int(self.position[padding_idx])
        self.is_compact = True
        try:
            yield
        finally:
            self.is_compact = False
            with torch.no_grad():
                full_embed[self.live] = embed.weight
                full_head[self.live] = head.weight
            embed.weight, head.weight, embed.padding_idx = full_embed, full_head, padding_idx

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        prompt_mask: torch.Tensor | None = None,
        prompt_weight: float = 0.0,
    ) -> torch.Tensor:
        positions = self.position[input_ids]
        if (positions < 0).any():
            raise ValueError("a token id is outside the tokenizer's live ids")
        ids = positions if self.is_compact else input_ids
        hidden = base_decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        weights = loss_mask[:, 1:].float()
        if prompt_mask is not None and prompt_weight > 0:
            weights = weights + prompt_weight * prompt_mask[:, 1:].float()
        keep = weights > 0
        targets = positions[:, 1:][keep]
        head = model.get_output_embeddings().weight
        logits = (hidden[keep] @ (head if self.is_compact else head[self.live]).T).float()
        dead = logits.new_full((logits.shape[0], 1), self.log_dead)
        losses = torch.logsumexp(torch.cat([logits, dead], dim=1), dim=1) - logits.gather(1, targets[:, None])[:, 0]
        return (losses * weights[keep]).sum() / weights[keep].sum()


def tokenizer_texts(cfg: RehearsalTargetConfig):
    """The demo's BPE corpus plus Kimi's role names and default system prompt (in every rendered prompt)."""
    extra = ["tool_declare", "tool", DEFAULT_SYSTEM_PROMPT, *SYSTEM_PROMPTS, "## Return of functions."]
    return itertools.chain(
        extra * 50,
        tokenizer_corpus(cfg.tokenizer_examples, cfg.seed + TOKENIZER_SEED_OFFSET, cfg.tokenizer_stdlib_chars),
    )


def build_rehearsal_target(out_dir: str | Path, cfg: RehearsalTargetConfig, log: Callable[[str], None] = print) -> dict:
    """Train the tokenizer and model, evaluate, and publish a save_pretrained folder (with its custom code)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, int(cfg.threads)))

    t = time.perf_counter()
    ranks = train_bpe_ranks(tokenizer_texts(cfg), cfg.bpe_ranks)
    tokenizer = write_tokenizer(tmp, ranks, model_max_length=cfg.max_position_embeddings)
    tokenizer_seconds = time.perf_counter() - t
    live_ids = [*range(len(ranks)), *range(SPECIAL_TOKENS_START, VOCAB_SIZE)]
    log(
        f"tokenizer: {len(ranks)} BPE ranks + 256 special ids at {SPECIAL_TOKENS_START}.., "
        f"{len(tokenizer)} ids ({tokenizer_seconds:.1f}s)"
    )

    model = build_model(cfg, live_ids)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: KimiK25ForConditionalGeneration(DeepseekV3 {cfg.num_hidden_layers}L x {cfg.hidden_size}, "
        f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), {n_params / 1e6:.2f}M params"
    )
    loss = LiveVocabLoss(live_ids, VOCAB_SIZE)
    with loss.compact(model):
        train_stats = pretrain(model, tokenizer, cfg, log, loss_fn=loss)
    metrics = evaluate(model, tokenizer, cfg, log, loss_fn=loss)

    ids = special_token_ids(tokenizer)
    # Kimi's generation_config: [EOS] is the tokenizer's eos, the turn end <|im_end|> stops generation.
    model.generation_config = GenerationConfig(
        bos_token_id=ids["[BOS]"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["[PAD]"]
    )
    model.save_pretrained(tmp)
    for name in REMOTE_MODEL_FILES:
        shutil.copyfile(Path(remote_code.__file__).parent / name, tmp / name)
    # The folder must load the way users and servers load Kimi: through its own code.
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), trust_remote_code=True)
    probe = torch.tensor([tokenizer.encode("Compute 3 + 4.", add_special_tokens=False)])
    with torch.no_grad():
        diff = (reloaded(probe).logits - model(probe).logits).abs().max().item()
    if diff > 1e-5:
        raise RuntimeError(f"the saved folder reloads with different logits (max diff {diff:g})")
    del reloaded

    report = {
        **report_opening(REPORT_FORMAT, cfg),
        "tokenizer": {
            "class": "TikTokenTokenizer (tokenization_kimi.py, trust_remote_code)",
            "bpe_ranks": len(ranks),
            "vocab_size": len(tokenizer),
            "special_token_ids": ids,
            "seconds": round(tokenizer_seconds, 2),
        },
        "model": {
            "architecture": "KimiK25ForConditionalGeneration",
            "text_architecture": "DeepseekV3ForCausalLM",
            "parameters": n_params,
            "dtype": "float32",
        },
        "train": train_stats,
        "metrics": metrics,
    }
    return publish_target(tmp, out_dir, report, REPORT_FILE, cfg.threads, t_start, log)


def main(argv: list[str] | None = None) -> None:
    out_dir, overrides = parse_build_args(
        "Build the Kimi-shaped rehearsal target (tiny DeepseekV3 in Kimi K2.5's wrapper, tiktoken tokenizer, "
        "synthetic tasks).",
        argv,
    )
    report = build_rehearsal_target(out_dir, dataclasses.replace(RehearsalTargetConfig(), **overrides))
    print(json.dumps({k: v for k, v in report["metrics"].items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
