"""API backends for the responses stage: OpenRouter/OpenAI-compatible clients, journal, money, and a local emulator."""
