"""mp-ckpt: sharded checkpoints that reshard on load, and the sharding description.

Installable alone (torch, numpy, safetensors): nothing here imports the rest of mp.

Names are imported on first use: `mp-ckpt --help` should not wait seconds for
torch, which only the commands themselves need.
"""

import importlib

_EXPORTS = {
    "Checkpointer": "mp_ckpt.core.checkpointer",
    "CheckpointSaveError": "mp_ckpt.core.checkpointer",
    "failure_line": "mp_ckpt.core.failures",
    "storage_key": "mp_ckpt.core.checkpointer",
    "CheckpointConfig": "mp_ckpt.core.config",
    "convert_checkpoint": "mp_ckpt.core.reshard",
    "export_hf": "mp_ckpt.hf",
    "export_hf_from_pieces": "mp_ckpt.hf",
    "check_export_target": "mp_ckpt.hf",
    "hf_directory_settings": "mp_ckpt.hf",
    "is_hf_directory": "mp_ckpt.hf",
    "load_hf_pieces": "mp_ckpt.hf",
    "import_hf": "mp_ckpt.hf",
    "logical_from_hf": "mp_ckpt.hf",
    "model_config_from_hf": "mp_ckpt.hf",
    "write_tokenizer_files": "mp_ckpt.hf.tokenizer",
    "CheckpointCorrupted": "mp_ckpt.core.integrity",
    "checkpoint_dir": "mp_ckpt.core.layout",
    "list_iterations": "mp_ckpt.core.layout",
    "read_tracker": "mp_ckpt.core.layout",
    "write_tracker": "mp_ckpt.core.layout",
    "LoadedCheckpoint": "mp_ckpt.core.loader",
    "load_checkpoint": "mp_ckpt.core.loader",
    "read_metadata": "mp_ckpt.core.loader",
    "import_megatron": "mp_ckpt.megatron.importer",
    "logical_from_megatron": "mp_ckpt.megatron.logical",
    "model_config_from_megatron": "mp_ckpt.megatron.settings",
    "UnsafePickleError": "mp_ckpt.megatron.safe_pickle",
    "safe_load": "mp_ckpt.megatron.safe_pickle",
    "MegatronModel": "mp_ckpt.megatron.read",
    "MegatronTensors": "mp_ckpt.megatron.read",
    "read_megatron": "mp_ckpt.megatron.read",
    "CheckpointReader": "mp_ckpt.core.reader",
    "Region": "mp_ckpt.core.regions",
    "ShardedTensor": "mp_ckpt.core.sharding",
    "assemble": "mp_ckpt.core.sharding",
    "check_tiling": "mp_ckpt.core.sharding",
}
"""Public name -> the module that defines it."""

__all__ = [
    "CheckpointConfig",
    "CheckpointCorrupted",
    "CheckpointReader",
    "CheckpointSaveError",
    "Checkpointer",
    "LoadedCheckpoint",
    "MegatronModel",
    "MegatronTensors",
    "Region",
    "ShardedTensor",
    "UnsafePickleError",
    "assemble",
    "check_export_target",
    "check_tiling",
    "checkpoint_dir",
    "convert_checkpoint",
    "export_hf",
    "export_hf_from_pieces",
    "failure_line",
    "hf_directory_settings",
    "import_hf",
    "import_megatron",
    "is_hf_directory",
    "list_iterations",
    "load_checkpoint",
    "load_hf_pieces",
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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mp_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
