"""Hugging Face <-> mp: import and export as loops over a family's rules (mp_ckpt.families),
tokenizer files beside them (tokenizer.py), safetensors written a tensor at a time; a
Hugging Face directory loaded straight into a run's pieces (lazy.py) and a run's pieces
exported straight to one (live_export.py)."""

from mp_ckpt.families import ARCHITECTURES
from mp_ckpt.hf.exporter import export_hf
from mp_ckpt.hf.importer import import_hf, logical_from_hf, model_config_from_hf
from mp_ckpt.hf.lazy import hf_directory_settings, is_hf_directory, load_hf_pieces
from mp_ckpt.hf.live_export import check_export_target, export_hf_from_pieces

__all__ = [
    "ARCHITECTURES",
    "check_export_target",
    "export_hf",
    "export_hf_from_pieces",
    "hf_directory_settings",
    "import_hf",
    "is_hf_directory",
    "load_hf_pieces",
    "logical_from_hf",
    "model_config_from_hf",
]
