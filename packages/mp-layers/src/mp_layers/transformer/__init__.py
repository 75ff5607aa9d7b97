"""Transformer building blocks: rotary embeddings, norms, core attention."""
