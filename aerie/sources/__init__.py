"""Reading prompt datasets from their sources (Hub sets, local files, HumanEval, the demo task language, recorded
answers) into the converted-prompt cache. Shared by the prompts stage, the recorded responses and the bench sets."""
