"""Training across ranks: process groups (context parallelism's too), DDP and FSDP2, full state dicts."""
