"""The EAGLE-3 drafter and its training.

- ``shape``: the drafter's shape (``DrafterConfig``) and its SGLang config.json, torch-free;
- ``model``: the drafter SGLang serves (layer, caches, SGLang export; re-exports ``shape``), Llama attention;
- ``mla_layer``: its multi-latent attention (the kind SGLang serves for Kimi K2.x);
- ``config``: the training settings (torch-free: parse time checks them);
- ``data``: hidden-shard windows, the held-out split, batches;
- ``ttt``: the training-time-test unroll and its loss against the target's distribution (checkpointed steps,
  chunked loss; ``layers.TTTAttention``: chunked attention), memory linear in the window;
- ``memory``: the peak memory of a training process from the settings (torch-free: the dry run's fit plan);
- ``evaluate``: held-out simulated acceptance;
- ``state``: checkpoint and exact resume;
- ``distributed``: torchrun processes and their share of each epoch;
- ``loop``: ``train_drafter``, the training loop read top to bottom;
- ``cli``: the command line torchrun starts.

Submodules are imported where used, so reading the settings never imports torch.
"""
