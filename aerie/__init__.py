"""aerie: prompt datasets -> a trained EAGLE-3 drafter for a target LLM, with proof it speeds the target up."""

__version__ = "0.1.0"
