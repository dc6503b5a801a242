"""Shared tools every stage may use: atomic publishing and JSONL (artifacts), progress with rate and ETA, rule logs,
GPU slots, degenerate-text flags. They import nothing else of aerie."""
