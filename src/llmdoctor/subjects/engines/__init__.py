"""In-process engines under test (llama.cpp, transformers, vLLM), each behind a small adapter."""
