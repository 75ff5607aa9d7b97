"""Unpickling Megatron-LM's files without Megatron, and without running their code.

    safe_load(path_or_bytes, name=...)     torch.load through an allow-list

A Megatron checkpoint pickles more than tensors: the run's argparse.Namespace,
Megatron's enums (AttnMaskType, ModelType, AttnBackend, ...), torch dtypes,
numpy RNG states, and torch.distributed.checkpoint's metadata classes. A
pickle may name any global, and unpickling calls it: a hostile file can run
`os.system`. So every global passes through an allow-list:

- torch's tensor and storage rebuilders, dtypes, torch.Size, torch.device;
  the plain containers (OrderedDict, set, frozenset, slice, complex);
- numpy arrays, dtypes and scalars (RNG states);
- torch.distributed.checkpoint's metadata dataclasses (.metadata);
- argparse.Namespace -> Namespace (a SimpleNamespace);
- any name under `megatron.` -> a stand-in class of that name that records
  what it was built from (megatron is never imported, nothing of it runs).

Any other global raises UnsafePickleError naming the file and the global,
before anything is called.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
import signal
import types
import zipfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["MegatronObject", "Namespace", "UnsafePickleError", "safe_load"]


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""


class Namespace(types.SimpleNamespace):
    """argparse.Namespace's stand-in: attributes only."""


class MegatronObject:
    """Base of the stand-ins for Megatron's classes: `megatron_name` is the class it
    replaces; `args` what it was called with (an enum's value), `state` its pickled
    state. An enum member's value is args[0]."""

    megatron_name = ""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        self.state = state

    @property
    def value(self):
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"{self.megatron_name}{self.args!r}"


_STAND_INS: dict[tuple[str, str], type] = {}


def _stand_in(module: str, name: str) -> type:
    key = (module, name)
    if key not in _STAND_INS:
        _STAND_INS[key] = type(name, (MegatronObject,), {"megatron_name": f"{module}.{name}"})
    return _STAND_INS[key]


def _numpy_globals() -> dict[tuple[str, str], object]:
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    found = {}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        for name in ("_reconstruct", "scalar"):
            found[(module, name)] = getattr(multiarray, name)
    found[("numpy", "ndarray")] = np.ndarray
    found[("numpy", "dtype")] = np.dtype
    for name in dir(np.dtypes):  # numpy >= 1.25 pickles dtypes by their class
        if name.endswith("DType"):
            found[("numpy.dtypes", name)] = getattr(np.dtypes, name)
    return found


def _torch_globals() -> dict[tuple[str, str], object]:
    import torch._utils as tu
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.distributed.checkpoint.planner as dcp_planner

    found: dict[tuple[str, str], object] = {
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.torch_version", "TorchVersion"): torch.torch_version.TorchVersion,  # a str
        ("torch", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): torch._tensor._rebuild_from_type_v2,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                 "_rebuild_parameter", "_rebuild_parameter_with_state"):  # fmt: skip
        if hasattr(tu, name):
            found[("torch._utils", name)] = getattr(tu, name)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[("torch", name)] = value
    for module in (dcp_md, dcp_fs, dcp_planner):
        for name in dir(module):
            value = getattr(module, name)
            # Their dataclasses and enums: plain records.
            if (
                isinstance(value, type)
                and value.__module__ == module.__name__
                and (hasattr(value, "__dataclass_fields__") or issubclass(value, enum.Enum))
            ):
                found[(module.__name__, name)] = value
    return found


def _latin1_encode(text: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """_codecs.encode as protocol-2 pickles use it (bytes written as latin-1 text)."""
    if encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"refused global _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1", errors)


_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("argparse", "Namespace"): Namespace,
    ("_codecs", "encode"): _latin1_encode,
    ("signal", "Signals"): signal.Signals,  # args.exit_signal
}
_LOADED = False


def _allowed() -> dict[tuple[str, str], object]:
    global _LOADED
    if not _LOADED:
        _ALLOWED.update(_numpy_globals())
        _ALLOWED.update(_torch_globals())
        _LOADED = True
    return _ALLOWED


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _allowed().get((module, name))
        if found is not None:
            return found
        if module == "megatron" or module.startswith("megatron."):
            return _stand_in(module, name)
        raise UnsafePickleError(f"refused global {module}.{name}")


class _PickleModule:
    """What torch.load needs of a pickle module."""

    Unpickler = _Unpickler
    UnpicklingError = pickle.UnpicklingError
    __name__ = "mp_ckpt.megatron.safe_pickle"

    @staticmethod
    def load(file, **kwargs):
        return _Unpickler(file, **kwargs).load()


def safe_load(source: str | os.PathLike | bytes, *, name: str | None = None,
              mmap: bool = False):  # fmt: skip
    """torch.load of a file (or its bytes) with the allow-list above, on the CPU.
    mmap: a file in torch's zip format is mapped, not read: its tensors are views of
    the file, paged in when used (other files are read whole).
    Raises UnsafePickleError naming the file (or `name`) and the refused global."""
    where = name or str(source)
    if mmap and not isinstance(source, bytes) and zipfile.is_zipfile(source):
        data = None
        opened = str(source)
    else:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        opened = io.BytesIO(data)
    try:
        return torch.load(opened, map_location="cpu", weights_only=False, mmap=data is None,
                          pickle_module=_PickleModule)  # fmt: skip
    except UnsafePickleError as error:
        raise UnsafePickleError(
            f"{where}: {error}: mp-ckpt unpickles only tensors, containers, torch dtypes, "
            "numpy arrays, argparse.Namespace and stand-ins for megatron's classes"
        ) from None


def safe_unpickle(data: bytes, *, name: str):
    """pickle.loads (not torch.load) with the same allow-list: DCP's .metadata."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafePickleError as error:
        raise UnsafePickleError(f"{name}: {error}") from None
