"""Custom code shipped inside the rehearsal target folder and loaded by transformers with trust_remote_code.

These files are copied verbatim into the built folder (``aerie.targets.rehearsal.build``) and referenced from
``config.json`` / ``tokenizer_config.json`` ``auto_map``, the way Kimi K2.5 ships ``configuration_kimi_k25.py``,
``modeling_kimi_k25.py`` and ``tokenization_kimi.py``. They import nothing from aerie: a server or a user
loading the folder needs only transformers and tiktoken. Written for aerie (not copied from Moonshot's code).
"""
