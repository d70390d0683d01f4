"""The model, exact on packed rows: presets, loading, the packed loss, the start-up check, LoRA, precision, fp8."""
