"""EAGLE-3 drafter: the model SGLang serves (model.py) and its training-time-test trainer (train.py)."""

from aerie.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter, TTTCache

__all__ = ["DrafterConfig", "DrafterKVCache", "Eagle3Drafter", "TTTCache"]
