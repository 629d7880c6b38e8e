"""Triton CUDA block kernels (registered in dequant.py for the CUDA device)."""
