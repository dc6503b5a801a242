"""The target model: everything aerie knows about the model it trains a drafter for, in one place.

- ``aerie.target_model.config``: its config.json (a multimodal wrapper's ``text_config``), depth, width,
  architectures, and the aux-layer id rules SGLang imposes. Pure Python: parse time imports only this.
- ``aerie.target_model.heads``: its embeddings, output head and final norm read from the safetensors files.
- ``aerie.target_model.model``: the tokenizer and model loaded by path, devices, dtypes, threads.
- ``aerie.target_model.template``: rendering a conversation with its own chat template (prompt ids, tool-call
  arguments as the template expects them, template errors that name the failing feature).
- ``aerie.target_model.chat``: its chat format probed from the template (turn end, stop ids, think tokens).
- ``aerie.target_model.turns``: the template's own text of a generated turn (what the tokens stage trains on).
- ``aerie.target_model.text_encoder``: text -> ids with added tokens as single ids, whatever the tokenizer's state.
"""
