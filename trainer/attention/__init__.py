"""Packed attention: backend choice and the HF glue, the varlen kernels, per-example positions, row boundaries."""
