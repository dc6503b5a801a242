"""The demo target: a tiny Llama with Kimi K2.5's chat tokens, pre-trained on a synthetic task language.

Built by the pipeline itself (``python -m aerie.demo_target.build OUT_DIR``) and loaded downstream by path
with AutoModelForCausalLM / AutoTokenizer, exactly like a real target. Modules:
- ``tasks``: the task families and the prompt generator the pipeline's prompt stage uses;
- ``tokenizer``: byte-level BPE + Kimi special tokens + Kimi-structured chat template;
- ``pretrain``: config, training loop and evaluation; ``build``: the atomic save_pretrained folder.
"""
