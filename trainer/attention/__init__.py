"""Packed attention: backend choice and the HF glue, the varlen kernels, positions, row boundaries, gathered keys."""
