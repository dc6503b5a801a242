"""The Kimi-shaped rehearsal target: Kimi K2.5's structure at toy size, built offline by the pipeline.

A tiny DeepseekV3 (MLA, MoE, dense first layer) inside Kimi K2.5's multimodal wrapper (``text_config``,
weights under ``language_model.``), a tiktoken tokenizer class with Kimi's special tokens at Kimi's ids in a
163,840-id vocabulary, and a K2.5-style chat template - all loaded with ``trust_remote_code`` from custom code
in the folder, as Kimi K2.5 is. Pre-trained briefly on the demo's task language so its answers are structured
(``reasoning</think>answer<|im_end|>``). Modules:
- ``remote_code``: the files copied into the folder (configuration, modeling, tokenization);
- ``tokenizer``: BPE training, ``tiktoken.model`` and ``tokenizer_config.json``;
- ``chat_template``: the template; ``build``: config, loss, training (the demo's loop), atomic publish.
"""
