"""Benchmarks: the bench rule's job (``job``: measure every trained drafter of the run with ``bench.backend``, plot,
gate), the run's methods - each trained drafter and reference with its role, drafter kind and draft width
(``methods``) - its settings checked at parse time (``settings``), its prompts (``prompts``), its verdict (``gate``,
one for both backends, each trained drafter judged on its own) and log lines (``summary``); the in-process backend
(``run``, ``speculative``: each drafter drafts through its kind), the SGLang backend (``serving``) over the serving
harness (``sglang_harness``: the run and its CLI; ``sglang_server``: server settings, command lines - a drafter's
from its kind - and lifecycle; ``sglang_client``: requests, responses and divergence probes; ``sglang_stats``:
statistics), and plots (``plots``).

Submodules are imported where used: the SGLang backend runs in SGLang's own environment, and the parse-time
modules (``settings``, ``methods``) must not pay for importing torch.
"""
