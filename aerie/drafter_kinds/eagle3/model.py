"""The EAGLE-3 drafter: one decoder layer that reads the target's aux hidden states.

Architecture and names follow SGLang 0.5.23's ``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/
llama_eagle3.py``; first read at commit 03d5a777) and, for ``attention: mla``, its
``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``), which differs only in the attention
(see mla_layer.py):

    embeds  = embed_tokens(input_ids)                       # target vocab, the target's (not exported)
    h       = fc(concat(aux layers))                        # first step only: [A*H] -> [H] (fc_norm: per chunk)
    x       = concat(input_layernorm(embeds), hidden_norm(h))   # embeds FIRST, then the hidden: [2H]
    r       = h + self_attn(x)                              # attention reads 2H, writes H; residual is h, un-normed
    out     = r + mlp(post_attention_layernorm(r))          # hidden_out: fed back to the next draft step
    logits  = lm_head(norm(out))                            # draft vocab (norm_output: norm(out) is fed back)

Token/position pairing (what the benchmark and training rely on), checked against SGLang's EAGLE worker:

* Draft extend (prefill, and after each verify): SGLang's ``EagleDraftInput.prepare_for_extend`` shifts
  ``input_ids`` left by one and appends the target's newly sampled token, while the forward keeps the
  target's own positions. So row ``t`` pairs the target feature at position ``t`` with token ``t+1`` at
  position id ``t`` and predicts token ``t+2``.
* Draft decode: the hidden state is the previous step's ``hidden_out`` (SGLang returns the pre-norm residual
  sum as ``hidden_states_to_aux``), the token is the previous draft, and the position advances by one per step:
  step ``k`` after row ``t`` uses position ``t+k``. This matches SGLang's overlap worker
  (``eagle_info_v2.prepare_for_v2_draft`` sets positions to ``seq_lens`` = last extend position + 1, and
  ``eagle_worker_v2.draft_forward`` increments after each forward) and the EAGLE reference (``len_posi`` =
  length of the shifted ids). Note: the non-overlap ``eagle_worker.draft_forward`` (commit 00559eac)
  increments *before* each draft forward, i.e. uses ``t+k+1``; RoPE makes that a one-position shift of
  the new query/key relative to the cached keys.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from aerie.drafter_kinds.blocks import SwiGLU
from aerie.drafter_kinds.eagle3.folder import (
    EAGLE31_SWITCHES,
    DrafterFolderError,
    read_drafter_folder,
    served_aux_layer_ids,
    tensor_problems,
)
from aerie.drafter_kinds.eagle3.folder import EMBED_NAME as embed_name
from aerie.drafter_kinds.eagle3.layers import DrafterKVCache, RMSNorm, TTTCache
from aerie.drafter_kinds.eagle3.llama_layer import LlamaAttention
from aerie.drafter_kinds.eagle3.mla_layer import MLAAttention
from aerie.drafter_kinds.eagle3.shape import (  # noqa: F401 - re-exported: the drafter's config lives in shape.py
    ATTENTION_KINDS,
    FORMAT,
    LLAMA_ON_MLA_HEAD_DIM,
    LLAMA_ON_MLA_KV_HEADS,
    READABLE_FORMATS,
    SGLANG_ARCHITECTURE,
    SGLANG_ARCHITECTURES,
    DrafterConfig,
)
from aerie.target_model.config import target_architectures, target_num_hidden_layers
from aerie.tools.artifacts import atomic_publish, write_safetensors

# The embeddings are the target's: exports leave them out (SGLang's EAGLE worker swaps in the target's,
# the in-process benchmark passes them to from_pretrained).
EMBED_NAME = "embed_tokens.weight"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class MidLayer(nn.Module):
    """SGLang's eagle3 decoder layer (``LlamaDecoderLayer`` in llama_eagle3.py, ``Eagle3MLADecoderLayer`` in
    kimi_k25_eagle3.py): the hidden state is the residual, embeds+hidden feed attention. Only the attention
    differs between the two kinds; SGLang's DeepseekV2MLP has the same gate/up/down SwiGLU as LlamaMLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the incoming hidden state
        self.self_attn: nn.Module = MLAAttention(cfg) if cfg.attention == "mla" else LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, cache) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        residual = hidden + self.self_attn(x, position_ids, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))  # pre-norm output


# ----------------------------------------------------------------------------------------------------------
# the drafter


def check_vocab_maps(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """d2t/t2d must describe the same ascending id set (aerie.draft-vocab/1 and SGLang's convention)."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(
            f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; "
            f"expected ({draft_vocab_size},) and ({vocab_size},)"
        )
    target_ids = torch.arange(draft_vocab_size) + d2t.long().cpu()
    if not torch.equal(target_ids, t2d.bool().cpu().nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: draft_id + d2t[draft_id] must list the t2d ids in ascending order")


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 drafter of either attention kind (``cfg.attention``); one API for training and the benchmark."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # shared with the target: SGLang swaps in the target's
        # True only for a drafter loaded from an export (which has no embeddings) until the target's are set.
        self.embeddings_missing = False
        self.fc = nn.Linear(cfg.num_aux_layers * H, H, bias=False)
        # EAGLE-3.1 fc_norm: each aux chunk normalised on its own before fc (SGLang: model.fc_norm.{i}).
        self.fc_norm = (
            nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers)) if cfg.fc_norm else None
        )
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # Until real maps are loaded: the draft vocab is the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- inference / training forward ---------------------------------------------------------------------

    def project_aux(self, aux_hidden_states: Tensor) -> Tensor:
        """[B, T, A*H] target aux states -> [B, T, H] first-step hidden state."""
        aux = aux_hidden_states.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.cfg.num_aux_layers, dim=-1)  # [B, T, H] each, in aux_layer_ids order
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        cache: DrafterKVCache | TTTCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft step without the vocabulary head: (normed [B,T,H], what lm_head reads; hidden_out [B,T,H],
        what the next draft step reads). Training applies lm_head itself, a chunk of rows at a time."""
        if self.embeddings_missing:
            raise RuntimeError(
                "this drafter was loaded from an export without embed_tokens (they are the target's): call "
                "load_target_embeddings(target.get_input_embeddings().weight) or pass embed_tokens= to from_pretrained"
            )
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # [B, T, H]
        hidden_out = self.midlayer(hidden_states, embeds, position_ids, cache)
        normed = self.norm(hidden_out)
        # SGLang returns the pre-norm sum as the next step's hidden state unless norm_output (EAGLE-3.1) is set.
        return normed, normed if self.cfg.norm_output else hidden_out

    def forward(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        cache: DrafterKVCache | TTTCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden_states [B,T,H], input_ids [B,T] (target ids), position_ids [B,T] -> (logits [B,T,Vd],
        hidden_out [B,T,H]).

        Without a cache the rows attend causally among themselves. A DrafterKVCache appends this call's
        keys (queries see all cached positions); a TTTCache applies the training-time-test pattern.
        """
        normed, hidden_out = self.step(hidden_states, input_ids, position_ids, cache)
        return self.lm_head(normed), hidden_out

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (SGLang: hot_token_id = d2t + arange)."""
        return draft_ids + self.d2t[draft_ids]

    # -- construction -------------------------------------------------------------------------------------

    def load_target_embeddings(self, embed: Tensor) -> None:
        """Copy in the target's input embeddings [V, H] (exports leave them out: they are the target's)."""
        if tuple(embed.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(
                f"target embeddings {tuple(embed.shape)} != ({self.cfg.vocab_size}, {self.cfg.hidden_size}) "
                "of the drafter: it was built for another target"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.detach())
        self.embeddings_missing = False

    def set_vocab_maps(self, d2t: Tensor, t2d: Tensor) -> None:
        check_vocab_maps(d2t, t2d, self.cfg.draft_vocab_size, self.cfg.vocab_size)
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    @classmethod
    def from_target(
        cls,
        target_model: nn.Module,
        cfg: DrafterConfig,
        d2t: Tensor,
        t2d: Tensor,
        init_head_from_target: bool = True,
    ) -> Eagle3Drafter:
        """New drafter with the target's embeddings copied and frozen.

        With ``init_head_from_target`` the draft lm_head starts as the target's lm_head rows of the draft
        vocab and the final norm as the target's final norm: the drafter learns to imitate the target's last
        hidden state, so that is a good prior (it stays trainable).
        """
        drafter = cls(cfg)
        embed = target_model.get_input_embeddings().weight
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embeddings {tuple(embed.shape)} != ({cfg.vocab_size}, {cfg.hidden_size})")
        drafter.set_vocab_maps(d2t, t2d)
        drafter.load_target_embeddings(embed.detach().float())
        with torch.no_grad():
            if init_head_from_target:
                head = target_model.get_output_embeddings().weight.detach().float()  # [V, H]
                ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
                drafter.lm_head.weight.copy_(head[ids])
                final_norm = getattr(getattr(target_model, "model", None), "norm", None)
                weight = getattr(final_norm, "weight", None)
                if weight is not None and weight.shape == drafter.norm.weight.shape:
                    drafter.norm.weight.copy_(weight.detach().float())
        return drafter

    # -- persistence --------------------------------------------------------------------------------------

    def save_pretrained(
        self, folder: str | Path, extra: dict | None = None, dtype: torch.dtype | None = torch.bfloat16
    ) -> None:
        """Write config.json + model.safetensors that SGLang loads (LlamaForCausalLMEagle3 or
        Eagle3DeepseekV2ForCausalLM, by ``cfg.attention``).

        The frozen embeddings are left out: SGLang's EAGLE worker replaces them with the target's after loading
        and the benchmark passes the target's to from_pretrained. Float weights are stored in ``dtype`` (bf16 by
        default, what SGLang serves; None keeps their dtype); d2t stays int64 and t2d bool. Each file is
        published atomically; config.json goes last.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, t in self.state_dict().items():
            if name == EMBED_NAME:
                continue
            t = t.detach().cpu()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()
        stored = dtype if dtype is not None else self.fc.weight.dtype
        meta = {"format": FORMAT}
        atomic_publish(folder / "model.safetensors", lambda p: write_safetensors(p, tensors, meta))
        config = self.cfg.to_hf_config(_DTYPE_NAMES[stored], dict(extra or {}))
        atomic_publish(folder / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        embed_tokens: Tensor | None = None,
        target: str | Path | None = None,
    ) -> Eagle3Drafter:
        """Load a drafter folder written by any tool in SGLang's layout (aerie's export, SpecForge, TorchSpec, a
        published drafter: ``aerie.drafter_kinds.eagle3.folder``); float weights are cast to ``dtype`` (fp32 by
        default).

        ``embed_tokens``: the target's input embeddings [V, H]. Exports do not carry them (format 1 folders
        did); without them the drafter loads but refuses to run until ``load_target_embeddings``.
        ``target``: the target's folder. With it, the drafter's aux layers are the ones SGLang serves it on that
        target (``served_aux_layer_ids``: SGLang's default when the folder names none, DeepSeek/Kimi's
        "+1 only when the first id is 1" spelling undone), in aerie's convention; without it the folder's ids are
        taken as aerie's convention (a folder that names none then needs ``target``). ``cfg.aux_layer_ids`` is
        what the in-process benchmark captures.
        """
        info = read_drafter_folder(folder)
        if target is not None:
            ids = served_aux_layer_ids(
                info.stated_aux_layer_ids, target_num_hidden_layers(target), target_architectures(target)
            )
        elif info.stated_aux_layer_ids is None:
            raise ValueError(
                f"{folder}: config.json names no eagle_config.eagle_aux_hidden_state_layer_ids, so the layers it reads "
                "are SGLang's default for the target's depth: pass target= (the target's folder)"
            )
        else:
            ids = info.stated_aux_layer_ids
        return cls.from_folder(info, ids, dtype=dtype, embed_tokens=embed_tokens)

    @classmethod
    def from_folder(
        cls,
        info,
        aux_layer_ids: Sequence[int],
        dtype: torch.dtype = torch.float32,
        embed_tokens: Tensor | None = None,
        switch_on: Sequence[str] = (),
    ) -> Eagle3Drafter:
        """The drafter of a read ``DrafterFolder`` (aerie.drafter_kinds.eagle3.folder) fed ``aux_layer_ids`` (aerie's
        convention): every stored tensor checked by name and shape, then loaded (``t2d`` rebuilt from ``d2t`` when
        absent). ``switch_on``: EAGLE 3.1 switches (``fc_norm``, ``norm_output``) the folder lacks and the drafter
        gets: the new fc_norm weights start at 1 (a plain RMSNorm), norm_output has no tensor."""
        cfg = info.drafter_config(aux_layer_ids)
        problems = tensor_problems(info, cfg)
        if problems:
            raise DrafterFolderError(info.path, problems)
        unknown = sorted(set(switch_on) - set(EAGLE31_SWITCHES))
        if unknown:
            raise ValueError(f"switch_on: {unknown} are not EAGLE 3.1 switches ({', '.join(EAGLE31_SWITCHES)})")
        cfg = dataclasses.replace(cfg, **{name: True for name in switch_on})
        state: dict[str, Tensor] = {}
        for file in sorted({t.file for t in info.tensors.values()}):
            stored = load_file(Path(info.path) / file)
            state.update({name: stored[t.stored_name] for name, t in info.tensors.items() if t.file == file})
        if "t2d" not in state:
            d2t = state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)).long()
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(cfg.draft_vocab_size) + d2t] = True
            state["t2d"] = t2d
        state["d2t"] = state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)).long()
        state["t2d"] = state["t2d"].bool()
        drafter = cls(cfg)
        drafter.load_state_dict(state, strict=False)
        check_vocab_maps(drafter.d2t, drafter.t2d, cfg.draft_vocab_size, cfg.vocab_size)
        if embed_tokens is not None:
            drafter.load_target_embeddings(embed_tokens.float())
        else:
            drafter.embeddings_missing = embed_name not in state
        return drafter.to(dtype)
