"""mp-ckpt: sharded checkpoints. Today: the sharding description models and optimizers give."""

from mp_ckpt.sharding import ShardedTensor, assemble, check_tiling

__all__ = ["ShardedTensor", "assemble", "check_tiling"]
