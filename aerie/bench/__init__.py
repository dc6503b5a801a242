"""Benchmarks: the bench rule's job (``job``: measure with ``bench.backend``, plot, gate), its settings checked at
parse time (``settings``), its prompts (``prompts``) and verdict (``gate``, one for both backends); the in-process
backend (``run``, ``speculative``), the SGLang backend (``serving``) over the serving harness (``sglang_harness``: the
run and its CLI; ``sglang_server``: server settings, command lines and lifecycle; ``sglang_client``: requests,
responses and divergence probes; ``sglang_stats``: statistics), degenerate-output detection (``degenerate``, one
definition for benchmarks and training data) and plots (``plots``).

Submodules are imported where used: the SGLang backend runs in SGLang's own environment, and the parse-time
modules (``settings``) must not pay for importing torch.
"""
