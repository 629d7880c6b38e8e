"""Rendering of findings: terminal, JSON envelope, HTML. Knows nothing of how they were measured."""
