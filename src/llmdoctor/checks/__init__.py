"""Checks: each a hypothesis, measured against the reference, with a verdict."""
