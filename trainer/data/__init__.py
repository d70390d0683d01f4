"""Packed folder -> micro-batches: the seeded stream, the row split over ranks, shard hashes, evaluation, HF datasets."""
