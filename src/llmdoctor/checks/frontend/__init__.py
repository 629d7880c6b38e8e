"""Checks of the front end: the file's tokenizer and chat template (audit), and an engine's own
tokenization against them (engine)."""
