"""Builders shared by the tests: tiny targets, their data and drafters.

- :func:`target_world`: a tiny target's own training data, as the pipeline would make it: greedy continuations
  of random prompts, their aux states (aerie.target_model.capture's hooks) and final states written as two hidden shards
  in the documented ``aerie.hidden/1`` (full) layout, and a draft vocab of the most frequent generated tokens
  (``aerie.draft-vocab/1``); :func:`world_drafter` an untrained EAGLE-3 drafter for it, :data:`TINY_TRAIN`
  how the tests train one.
- :func:`save_tiny_llama_target`: a random 6-layer Llama with a trained Kimi-style tokenizer, saved like a real
  target; :func:`write_random_tokens_shard`: an ``aerie.tokens/3`` shard of random ids, the second half of each
  sequence supervised (capture and store tests).
- :func:`char_chat_tokenizer` and :func:`write_prompts`: what a saved target needs for the in-process
  benchmark (a character-level tokenizer with a chat template) and the prompts it runs on.

Seeds are the callers': :func:`target_world` draws nothing from torch's global generator, so a target built
after ``torch.manual_seed`` keeps its weights and everything after it stays reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.target_model.capture import AuxHiddenCapture

# How the tests train a tiny world's drafter (short windows, small batches, one thread); epochs are each test's.
TINY_TRAIN: dict[str, Any] = dict(
    ttt_steps=3,
    learning_rate=3e-3,
    warmup_ratio=0.05,
    batch_size=8,
    max_seq_len=64,
    eval_fraction=0.2,
    seed=0,
    threads=1,
    log_every=5,
    grad_clip=1.0,
)


def write_hidden_v1_shard(
    path: Path, seqs: list[dict], *, aux_layer_ids: Sequence[int], target_config: Any, target_dir: Path
) -> None:
    """One ``aerie.hidden/1`` shard of ``seqs`` (dicts with id, ids, mask, aux [T, A*H], final [T, H]), states
    stored in bf16 as the capture stage stores the full layout."""
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s["ids"]))
    tensors = {
        "input_ids": torch.cat([s["ids"] for s in seqs]).to(torch.int32),
        "loss_mask": torch.cat([s["mask"] for s in seqs]).to(torch.uint8),
        "seq_offsets": torch.tensor(offsets, dtype=torch.int64),
        "aux_hidden_states": torch.cat([s["aux"] for s in seqs]).to(torch.bfloat16),
        "final_hidden_states": torch.cat([s["final"] for s in seqs]).to(torch.bfloat16),
    }
    meta = {
        "format": "aerie.hidden/1",
        "aux_layer_ids": json.dumps(list(aux_layer_ids)),
        "num_hidden_layers": str(target_config.num_hidden_layers),
        "hidden_size": str(target_config.hidden_size),
        "vocab_size": str(target_config.vocab_size),
        "target": str(target_dir),
        "sample_ids": json.dumps([s["id"] for s in seqs]),
    }
    save_file(tensors, str(path), metadata=meta)


def greedy_sequences(
    target: nn.Module,
    aux_layer_ids: Sequence[int],
    *,
    num_seqs: int,
    prompt_len: int,
    new_tokens: int,
    id_prefix: str,
    seed: int = 1,
) -> list[dict]:
    """The target's greedy continuations of ``num_seqs`` random prompts (all at once: equal prompt lengths),
    with the aux states of ``aux_layer_ids`` and the final post-norm states; the loss mask covers the
    generated tokens."""
    vocab_size = target.config.vocab_size
    ids = torch.randint(3, vocab_size, (num_seqs, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        with AuxHiddenCapture(target, list(aux_layer_ids)) as cap:
            final = target.model(input_ids=ids).last_hidden_state  # after the final norm
            aux = cap.aux_hidden_states()
    mask = torch.zeros(ids.shape[1], dtype=torch.bool)
    mask[prompt_len:] = True
    return [
        {"id": f"{id_prefix}/{i}", "ids": ids[i], "mask": mask, "aux": aux[i], "final": final[i]}
        for i in range(num_seqs)
    ]


def write_draft_vocab(
    path: Path, seqs: list[dict], vocab_size: int, draft_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``aerie.draft-vocab/1`` file keeping the ``draft_vocab`` most frequent generated tokens, draft ids
    ordered by target id; returns (d2t, t2d)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(s["ids"][s["mask"]], minlength=vocab_size)
    draft_ids = torch.sort(torch.argsort(counts, descending=True, stable=True)[:draft_vocab]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(draft_vocab)
    save_file(
        {"d2t": d2t, "t2d": t2d, "token_counts": counts},
        str(path),
        metadata={
            "format": "aerie.draft-vocab/1",
            "draft_vocab_size": str(draft_vocab),
            "target_vocab_size": str(vocab_size),
            "coverage": str(float(counts[draft_ids].sum() / counts.sum())),
        },
    )
    return d2t, t2d


def target_world(
    root: Path,
    target: nn.Module,
    *,
    aux_layer_ids: Sequence[int],
    draft_vocab: int,
    num_seqs: int,
    prompt_len: int,
    new_tokens: int,
    id_prefix: str,
) -> dict[str, Any]:
    """Save ``target`` under ``root/target``, write its greedy data as two hidden shards (half the sequences
    each) and a draft vocab; the dict the tests' ``world`` fixtures share."""
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    seqs = greedy_sequences(
        target, aux_layer_ids, num_seqs=num_seqs, prompt_len=prompt_len, new_tokens=new_tokens, id_prefix=id_prefix
    )
    shards = [root / "shard-00000.safetensors", root / "shard-00001.safetensors"]
    for path, part in zip(shards, (seqs[: num_seqs // 2], seqs[num_seqs // 2 :])):
        write_hidden_v1_shard(
            path, part, aux_layer_ids=aux_layer_ids, target_config=target.config, target_dir=target_dir
        )
    vocab = root / "draft_vocab.safetensors"
    d2t, t2d = write_draft_vocab(vocab, seqs, target.config.vocab_size, draft_vocab)
    return {
        "root": root,
        "target": target,
        "target_dir": target_dir,
        "shards": shards,
        "vocab": vocab,
        "seqs": seqs,
        "d2t": d2t,
        "t2d": t2d,
        "aux_layer_ids": list(aux_layer_ids),
    }


def world_drafter(world: dict[str, Any], seed: int = 0, **shape: Any) -> Eagle3Drafter:
    """An untrained drafter for the world's target and draft vocab (``shape``: DrafterConfig.from_target's
    settings), in eval mode; its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    target = world["target"]
    cfg = DrafterConfig.from_target(target.config, len(world["d2t"]), world["aux_layer_ids"], **shape)
    return Eagle3Drafter.from_target(target, cfg, world["d2t"], world["t2d"]).eval()


def char_chat_tokenizer(specials: Sequence[str]) -> tuple[Any, dict[str, int]]:
    """(tokenizer, vocab): a character-level tokenizer over printable ASCII after ``specials`` (which must
    hold ``<unk>``, ``<s>``, ``<|end|>``, ``<|assistant|>`` and every role's ``<|role|>``), with a chat
    template that wraps each message as ``<|role|>content<|end|>``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, *(chr(c) for c in range(32, 127))])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.add_special_tokens(list(specials))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|end|>",
        chat_template=(
            "{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        ),
    )
    return tok, vocab


def write_prompts(path: Path, texts: Sequence[str], dataset: str = "demo") -> None:
    """An ``aerie.prompts/1`` file of one user message per text, ids ``<dataset>/<i>``."""
    records = [
        {
            "format": "aerie.prompts/1",
            "id": f"{dataset}/{i}",
            "dataset": dataset,
            "messages": [{"role": "user", "content": text}],
            "source": {"kind": "test"},
        }
        for i, text in enumerate(texts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def save_tiny_llama_target(path: Path) -> Path:
    """A random 6-layer Llama (hidden 32) and a Kimi-style tokenizer trained on 300 chat texts, saved at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aerie.targets.demo.tokenizer import tokenizer_corpus, train_tokenizer

    tok = train_tokenizer(tokenizer_corpus(300, seed=1), vocab_size=400)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_random_tokens_shard(path: Path, seqs: int, seq_len: int, seed: int) -> None:
    """An ``aerie.tokens/3`` shard of ``seqs`` random sequences of ``seq_len`` ids (second halves supervised)."""
    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.tools.artifacts import save_packed

    ids = torch.randint(3, 200, (seqs, seq_len), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[seq_len // 2 :] = 1
    save_packed(
        path,
        {
            "input_ids": ids.flatten().to(torch.int32),
            "loss_mask": mask.repeat(seqs),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
        },
        {
            "format": TOKENS_FORMAT,
            "sample_ids": [f"tasks/{seed}-{i}" for i in range(seqs)],
            "generation_prompt_ids": [],
            "stop_ids": [],
            "cut_sequences": list(range(seqs)),
        },
    )


def save_random_llama(path: Path, max_position_embeddings: int = 128) -> Path:
    """A random 6-layer Llama (hidden 64, vocabulary 200, no tokenizer) saved at ``path``: capture-only tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=200,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_position_embeddings,
        )
    ).save_pretrained(path)
    return path
