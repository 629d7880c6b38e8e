"""Checks of the whole computation: an engine's layers, logits, decode steps and discrete choices
(MoE routing, attention backends) against the reference run that emulates its arithmetic."""
