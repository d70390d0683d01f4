"""The packed folder into micro-batches: its checks, the seeded stream, shard hashes, evaluation data, HF datasets."""
