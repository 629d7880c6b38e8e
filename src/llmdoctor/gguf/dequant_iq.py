"""Block kernels for the IQ (importance-matrix) types (registered in dequant.py)."""
