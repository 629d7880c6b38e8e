"""Checks of a live OpenAI-compatible endpoint, black-box (probes)."""
