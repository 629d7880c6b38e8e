"""Checks of the tensor layout: the GGUF<->HF name map and its transforms, and the layout bugs a
loader makes (a wrong block offset, a missing permutation)."""
