"""The responses stage: in-process generation (in_process), an OpenAI-compatible API (api/), recorded
answers (recorded)."""
