"""Benchmarks: in-process speculative decoding (``run``, ``speculative``), the SGLang serving harness
(``sglang_harness``), degenerate-output detection (``degenerate``) and plots (``plots``).

Submodules are imported where used: the SGLang harness runs in SGLang's own environment and must not
pay for importing torch here.
"""
