"""Training across ranks: process groups, DDP and FSDP2, full state dicts, context parallelism."""
