"""mp-ckpt: sharded checkpoints that reshard on load, and the sharding description.

Installable alone (torch, numpy, safetensors): nothing here imports the rest of mp.
"""

from mp_ckpt.checkpointer import Checkpointer, storage_key
from mp_ckpt.config import CheckpointConfig
from mp_ckpt.convert import convert_checkpoint
from mp_ckpt.hf import export_hf, import_hf, logical_from_hf, model_config_from_hf
from mp_ckpt.hf_tokenizer import write_tokenizer_files
from mp_ckpt.integrity import CheckpointCorrupted
from mp_ckpt.layout import checkpoint_dir, list_iterations, read_tracker, write_tracker
from mp_ckpt.loader import LoadedCheckpoint, load_checkpoint, read_metadata
from mp_ckpt.megatron import import_megatron, logical_from_megatron, model_config_from_megatron
from mp_ckpt.megatron_pickle import UnsafePickleError, safe_load
from mp_ckpt.megatron_read import MegatronModel, MegatronTensors, read_megatron
from mp_ckpt.reader import CheckpointReader
from mp_ckpt.regions import Region
from mp_ckpt.sharding import ShardedTensor, assemble, check_tiling

__all__ = [
    "CheckpointConfig",
    "CheckpointCorrupted",
    "CheckpointReader",
    "Checkpointer",
    "LoadedCheckpoint",
    "MegatronModel",
    "MegatronTensors",
    "Region",
    "ShardedTensor",
    "UnsafePickleError",
    "assemble",
    "check_tiling",
    "checkpoint_dir",
    "convert_checkpoint",
    "export_hf",
    "import_hf",
    "import_megatron",
    "list_iterations",
    "load_checkpoint",
    "logical_from_hf",
    "logical_from_megatron",
    "model_config_from_hf",
    "model_config_from_megatron",
    "read_megatron",
    "read_metadata",
    "read_tracker",
    "safe_load",
    "storage_key",
    "write_tokenizer_files",
    "write_tracker",
]
