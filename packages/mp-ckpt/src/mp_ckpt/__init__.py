"""mp-ckpt: sharded checkpoints. Nothing is public yet; see README.md."""

__all__: list[str] = []
