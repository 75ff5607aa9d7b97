"""Hugging Face <-> mp: import and export as loops over a family's rules (mp_ckpt.families),
tokenizer files beside them (tokenizer.py), safetensors written a tensor at a time."""

from mp_ckpt.families import ARCHITECTURES
from mp_ckpt.hf.exporter import export_hf
from mp_ckpt.hf.importer import import_hf, logical_from_hf, model_config_from_hf

__all__ = ["ARCHITECTURES", "export_hf", "import_hf", "logical_from_hf", "model_config_from_hf"]
