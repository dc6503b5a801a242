"""The prompts stage: prompt shards of each dataset (rule prompts) and the benchmark sets (rule bench_set)."""
