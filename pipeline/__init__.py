"""Offline pipeline: read a dataset, tokenize it, plan bins, write packed Arrow shards, report, verify."""
