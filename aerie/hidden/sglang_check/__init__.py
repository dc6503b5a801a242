"""The first GPU step: SGLang's capture checked against transformers (aerie-sglang-capture)."""
