"""The draft vocabulary stage (rule draft_vocab)."""
