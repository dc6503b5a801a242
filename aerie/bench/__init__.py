"""Benchmarks: in-process speculative decoding (``run``, ``speculative``), the SGLang serving harness
(``sglang_harness``: the run and its CLI; ``sglang_server``: server settings, command lines and lifecycle;
``sglang_client``: requests and responses; ``sglang_stats``: statistics), degenerate-output detection
(``degenerate``, one definition for benchmarks and training data) and plots (``plots``).

Submodules are imported where used: the SGLang harness runs in SGLang's own environment and must not
pay for importing torch here.
"""
