"""Checks of single kernels against the reference: dequantization and attention."""
