"""Minimal trainer that streams packed shards into a causal LM with varlen attention."""
