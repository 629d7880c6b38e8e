"""llmdoctor: finds out why an LLM deployment produces garbage."""

__version__ = "0.1.0"
