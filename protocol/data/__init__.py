"""The run's dataset: corpus, tokenizer, shards and token streams, the deterministic assignment of
batches, and the store-backed dataset with its verified cache."""
