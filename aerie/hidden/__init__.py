"""Stage 4: token shards -> target hidden states (format ``aerie.hidden/2``, aerie.formats.hidden).

A capture backend runs the target over each training sequence and returns, per sequence, the EAGLE-3 aux
layers' outputs (SGLang's layer convention, see aerie.target_model.config) and the final post-norm hidden state:
``hf`` in-process with transformers hooks, ``sglang`` through SGLang's engine (aerie.hidden.sglang).
Every shard is checked on the full-precision states, before anything is compressed: finite values, aux
layers neither all zero, constant nor identical to each other, one state per token of the tokens shard, and
``lm_head(final)`` reproducing the recorded next token on generated positions (greedy data).

The target is loaded once per run, not once per shard (:func:`capture_shards`, rule ``hidden``): every shard
is captured into the capture store (aerie.target_model.store) and hard-linked to its output, so a rerun after a
crash reuses the finished shards and captures only the rest, with one load.

Two storage layouts (``hidden.layout``, both documented in docs/formats.md):

- ``full``: aux [T, A*H] and final [T, H] in ``storage_dtype`` (bf16: 8H bytes a token for A = 3, the
  layout SpecForge stores). Training applies the target's lm_head to the final states.
- ``compact`` (default): aux in float8 e4m3 with one fp32 scale per (token, aux layer), and instead of the
  final state the target's top-k next-token log-probabilities, computed here through the full lm_head in
  fp32. About 3H + 6k bytes a token (0.38x of full for Kimi K2.5), and training needs no [V, H] lm_head.

One module per job; each imports only those above it:

- :mod:`~aerie.hidden.checks`: the checks on the full-precision states (:class:`HiddenStateError`);
- :mod:`~aerie.hidden.head`: the top-k targets from the lm_head, and the ``sglang`` backend's copy of the head
  (placed on SGLang's rank-0 GPU before SGLang sizes its memory pools);
- :mod:`~aerie.hidden.backends`: the ``hf`` and ``sglang`` backends and :class:`TargetSession`, the target
  loaded at most once and its loads counted;
- :mod:`~aerie.hidden.shard`: one tokens shard -> one checked, compressed hidden shard (:func:`capture_shard`);
- :mod:`~aerie.hidden.run`: the capture job, every shard of a run with one load (:func:`capture_shards`).
"""
