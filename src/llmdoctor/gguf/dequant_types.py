"""Block kernels for the float, legacy, K, ternary and FP4 types (registered in dequant.py)."""
