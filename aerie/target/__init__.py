"""The target model: everything aerie knows about the model it trains a drafter for, in one place.

- ``aerie.target.config``: its config.json (a multimodal wrapper's ``text_config``), depth, width,
  architectures, and the aux-layer id rules SGLang imposes. Pure Python: parse time imports only this.
- ``aerie.target.heads``: its embeddings, output head and final norm read from the safetensors files.
- ``aerie.target.model``: the tokenizer and model loaded by path, devices, dtypes, threads.
- ``aerie.target.chat``: prompt rendering with its own chat template, and how a generated turn is framed.
"""
