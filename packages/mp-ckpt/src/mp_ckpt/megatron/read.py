"""Reading a Megatron-LM training checkpoint's model tensors, without Megatron.

    read_megatron(src, iteration=None) -> MegatronModel(directory, iteration, args,
                                                        format, tensors)

`tensors` holds Megatron's own names and fused layouts, whole (not TP-split),
one entry per layer ("decoder.layers.<i>."), as Megatron saved them. It is a
MegatronTensors mapping: shapes and dtypes come from the metadata, and each
tensor is read from disk only when it is looked up (never kept), so a caller
that takes one tensor at a time holds one tensor at a time:

- torch_dist: one torch.distributed.checkpoint folder. Keys have no "model."
  prefix and stack the layers in a leading dimension; each key's global tensor
  is already layout-neutral (QKV interleaved by query group over all groups,
  a SwiGLU fc1 as [gate; up]). The non-tensor state (args, iteration) is a
  pickled object under "common_state/..." (or common.pt beside it).
- torch (legacy): iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt per TP
  (and PP, and EP) rank, per-layer keys local to the rank and TP-sliced; each
  pipeline stage numbers its layers from 0, each expert-parallel rank its
  experts (mlp.experts.local_experts.<e>), which are renamed to their global
  numbers; what is not an expert is read from EP rank 0, and the word embedding
  from the first stage (the last one holds a copy for multi-token prediction).
  A multi-token prediction module's layer, mtp.layers.<k>.mtp_model_layer.* in
  megatron-core's module names, is renamed transformer_layer as its torch_dist
  keys have it (a hybrid model's module keeps mtp_model_layer.layers.<j>.*, its
  layers' name in both formats). The saved args say
  which of the folder's numbers is PP and which EP. TP pieces join as tp_layout.py says:
  column-parallel tensors are joined on rows,
  row-parallel on columns; a SwiGLU fc1 is [gate_r; up_r] per rank and is
  regrouped into [gate; up]; QKV rows join as they are (each rank holds whole
  query groups, so the concatenation is the interleaved whole), and so do
  multi-latent attention's linear_q_proj / linear_q_up_proj / linear_kv_up_proj
  (whole heads per rank). Its down projections are column-parallel in
  Megatron's local spec (joined on rows) and whole on every rank in the TE spec
  (a rank holding all q_lora_rank, or kv_lora_rank + qk_pos_emb_head_dim, rows).

A hybrid model's (HybridModel's) Mamba mixers: torch_dist keeps the parts of in_proj
(z, x, B, C, dt) and of conv1d (x, B, C) as keys of their own (mixer.in_proj.weight.z,
...), which are joined here into the whole fused tensor, [z; x; B; C; dt] on rows; the
legacy files hold each rank's [z_r; x_r; B_r; C_r; dt_r] (its heads' and groups' rows of
each part) and conv1d as mixer.conv1d_weight / conv1d_bias, joined part by part and
named mixer.conv1d.weight / .bias as in torch_dist; A_log, D, dt_bias and the gated norm
are split on rows, out_proj on columns.

- torch_dist reads one layer's chunks of a stacked key (DCP reads the stored
  chunks that overlap it straight into the tensor); legacy torch maps the rank
  files (torch.load mmap) and joins one tensor's TP pieces, paged in then.

Every pickle goes through safe_pickle's allow-list; .metadata too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mp_ckpt.core.box_reads import KeptMetadataReader, read_boxes
from mp_ckpt.core.checkpointer import single_process_quiet
from mp_ckpt.megatron.safe_pickle import safe_load, safe_unpickle
from mp_ckpt.megatron.settings import gated
from mp_ckpt.megatron.tp_layout import join_pieces, latent_rows, mamba_parts, whole_rows

__all__ = [
    "MegatronModel",
    "MegatronTensors",
    "global_expert_name",
    "join_mamba_parts",
    "legacy_name",
    "legacy_rank_files",
    "read_megatron",
    "resolve_megatron",
]

_TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_\d+(?:_\d+){0,2}$")
# A legacy file's expert: decoder.layers.<i>.mlp.experts.local_experts.<local number>.<rest>
_LOCAL_EXPERT = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer"
    r"(?:\.layers\.\d+)?))"
    r"\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$"
)
# A multi-token prediction module's layer under its legacy module name (a GPT model's; a
# hybrid model's module holds layers, mtp_model_layer.layers.<j>., under that name always)
_MTP_MODEL_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.(?!layers\.\d+\.)")
# Transformer Engine's grouped experts: mlp.experts.linear_fc1.weight<local number>
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.(weight|bias)\d+$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# torch_dist's parts of them: mixer.in_proj.weight.z, mixer.conv1d.bias.x, ...
# A Mamba mixer's or a gated DeltaNet's fused tensor's parts (torch_dist's keys X.<part>)
_MAMBA_PART = re.compile(
    r"^(.+\.(mixer|self_attention)\.(in_proj|conv1d)\.(?:weight|bias))"
    r"\.(z|x|B|C|dt|query|key|value|beta|alpha)$"
)
_PART_ORDER = {("mixer", "in_proj"): ("z", "x", "B", "C", "dt"),
               ("mixer", "conv1d"): ("x", "B", "C"),
               ("self_attention", "in_proj"): ("query", "key", "value", "z", "beta", "alpha"),
               ("self_attention", "conv1d"): ("query", "key", "value")}  # fmt: skip
# The legacy files' names of conv1d's tensors (the mixer holds them itself)
_LEGACY_CONV = re.compile(r"\.mixer\.conv1d_(weight|bias)$")


class MegatronTensors(Mapping):
    """name -> tensor, each read when looked up (a new tensor every time, not kept)."""

    def __init__(self) -> None:
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype, Callable]] = {}

    def add(self, name: str, shape, dtype: torch.dtype, read: Callable[[], torch.Tensor]):
        self._specs[name] = (tuple(shape), dtype, read)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._specs[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._specs[name][2]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


@dataclasses.dataclass
class MegatronModel:
    directory: Path
    iteration: int
    args: object
    format: str
    tensors: Mapping[str, torch.Tensor]
    checkpoint_version: float | None = None


def resolve_megatron(src: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int]:
    """(iter_XXXXXXX directory, iteration) of a Megatron checkpoint root or iteration dir."""
    src = Path(src)
    match = re.fullmatch(r"iter_(\d+)", src.name)
    if match and iteration is None:
        return src, int(match.group(1))
    if iteration is None:
        tracker = src / _TRACKER
        if not tracker.exists():
            raise FileNotFoundError(f"{src}: no {_TRACKER} (pass --iteration or an iter_* dir)")
        text = tracker.read_text().strip()
        if text == "release":
            directory = src / "release"
            if not directory.is_dir():
                raise FileNotFoundError(f"{tracker} says 'release' but {directory} is missing")
            return directory, 0
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(f"{tracker}: expected an iteration number, got {text!r}") from None
    directory = src / f"iter_{iteration:07d}"
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is missing")
    return directory, iteration


def read_megatron(src: str | os.PathLike, iteration: int | None = None) -> MegatronModel:
    directory, number = resolve_megatron(src, iteration)
    if (directory / ".metadata").exists():
        return _read_torch_dist(directory, number)
    if any(_RANK_DIR.match(p.name) for p in directory.iterdir()):
        return _read_torch(directory, number)
    raise ValueError(
        f"{directory}: neither a torch_dist checkpoint (.metadata) nor a legacy torch one "
        "(mp_rank_* folders); other Megatron formats (zarr, fsdp_dtensor) are not imported"
    )


# --- torch_dist -------------------------------------------------------------------------


class _SafeReader(KeptMetadataReader):
    """DCP's reader, with .metadata unpickled through the allow-list, once per reader."""

    def parse_metadata(self, path):
        path = Path(path)
        return safe_unpickle(path.read_bytes(), name=str(path))


class _RawBytesPlanner(DefaultLoadPlanner):
    """Keeps byte items as bytes (DCP's default would unpickle them unchecked)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def _read_torch_dist(directory: Path, iteration: int) -> MegatronModel:
    storage = _SafeReader(directory)  # every read of this checkpoint's tensors goes through it
    entries = storage.read_metadata().state_dict_metadata
    common_keys = [k for k in entries if k.startswith("common_state")]
    if common_keys:
        planner = _RawBytesPlanner()
        with single_process_quiet():
            dcp.load({common_keys[0]: io.BytesIO()}, storage_reader=storage, planner=planner,
                     no_dist=True)  # fmt: skip
        common = safe_load(planner.raw[common_keys[0]], name=f"{directory}:{common_keys[0]}")
        if isinstance(common, list) and common:  # a ShardedObject: one entry per saving rank
            common = common[0]
    elif (directory / "common.pt").exists():
        common = safe_load(directory / "common.pt")
    else:
        raise FileNotFoundError(f"{directory}: no common_state item nor common.pt (the args)")
    args = _args(common, directory)
    tensors = MegatronTensors()
    for key, entry in entries.items():
        if key.startswith(("optimizer.", "rng_state", "common_state")) or "_extra_state" in key:
            continue
        if isinstance(entry, BytesStorageMetadata):
            continue
        shape, dtype = tuple(entry.size), entry.properties.dtype
        rest = key.removeprefix("decoder.layers.")
        if rest != key and not _LAYER.match(key):  # stacked: [layers, ...]
            for i in range(shape[0]):
                read = functools.partial(_read_dist_box, storage, key, shape, dtype, i)
                tensors.add(f"decoder.layers.{i}.{rest}", shape[1:], dtype, read)
        else:
            read = functools.partial(_read_dist_box, storage, key, shape, dtype)
            tensors.add(key, shape, dtype, read)
    return MegatronModel(directory, iteration, args, "torch_dist", _join_mamba_parts(tensors),
                         common.get("checkpoint_version"))  # fmt: skip


def join_mamba_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_join_mamba_parts of tensors held in memory (an optimizer state's, say)."""
    lazy = MegatronTensors()
    for name, tensor in tensors.items():
        lazy.add(name, tensor.shape, tensor.dtype, lambda t=tensor: t)
    joined = _join_mamba_parts(lazy)
    return {name: joined[name] for name in joined}


def _join_mamba_parts(tensors: MegatronTensors) -> MegatronTensors:
    """The tensors with each Mamba mixer's and gated DeltaNet's in_proj and conv1d parts
    (torch_dist's keys X.z, X.x, ..., X.query, ...) joined into X, the parts on rows in
    their fused order."""
    parts: dict[str, dict[str, str]] = {}
    for key in tensors:
        match = _MAMBA_PART.match(key)
        if match:
            parts.setdefault(match.group(1), {})[match.group(4)] = key
    out = MegatronTensors()
    for key in tensors:
        match = _MAMBA_PART.match(key)
        if match is None:
            out.add(key, tensors.shape(key), tensors.dtype(key), lambda k=key: tensors[k])
            continue
        name, order = match.group(1), _PART_ORDER[match.group(2), match.group(3)]
        if name in out:
            continue
        if sorted(parts[name]) != sorted(order):
            raise ValueError(f"{name}: torch_dist holds its parts {sorted(parts[name])}, "
                             f"expected {', '.join(order)}")  # fmt: skip
        keys = [parts[name][p] for p in order]
        shapes = [tensors.shape(k) for k in keys]
        rows = sum(shape[0] for shape in shapes)
        out.add(name, (rows, *shapes[0][1:]), tensors.dtype(keys[0]),
                lambda ks=keys: torch.cat([tensors[k] for k in ks]))  # fmt: skip
    return out


def _read_dist_box(storage: _SafeReader, key: str, shape, dtype, layer: int | None = None):
    """The stored tensor `key` whole, or its slice `layer` of the leading dimension."""
    if layer is None:
        out = torch.empty(shape, dtype=dtype)
        target, box = out, tuple(slice(0, n) for n in shape)
    else:
        out = torch.empty(shape[1:], dtype=dtype)
        target = out.unsqueeze(0)
        box = (slice(layer, layer + 1), *(slice(0, n) for n in shape[1:]))
    read_boxes(storage.path, {key: [(box, target)]}, distributed=False, storage_reader=storage)
    return out


def _args(common: object, where: Path):
    if not isinstance(common, dict) or common.get("args") is None:
        raise ValueError(f"{where}: the checkpoint holds no 'args' (Megatron's arguments)")
    return common["args"]


# --- torch (legacy) ---------------------------------------------------------------------


def legacy_rank_files(directory: Path) -> tuple[object, dict[tuple[int, int, int], Path]]:
    """(args, {(pp rank, ep rank, tp rank): model_optim_rng.pt}) of a legacy checkpoint.

    Megatron names a rank's folder mp_rank_TT, then _PPP with pipeline parallelism, then
    _EEE with expert parallelism, so the saved args say which number is which."""
    folders = {}
    for path in directory.iterdir():
        match = _RANK_DIR.match(path.name)
        if match:
            folders[tuple(int(n) for n in path.name.removeprefix("mp_rank_").split("_"))] = path
    first = folders[min(folders)] / "model_optim_rng.pt"
    if not first.exists():
        raise FileNotFoundError(f"{first} is missing")
    args = _args(safe_load(first, mmap=True), first)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    files = {}
    for numbers, path in folders.items():
        expected = 1 + (pp > 1) + (ep > 1)
        if len(numbers) != expected:
            raise ValueError(f"{path}: the args say TP {tp} x PP {pp} x EP {ep}, whose rank "
                             f"folders are named by {expected} numbers")  # fmt: skip
        t, rest = numbers[0], list(numbers[1:])
        p = rest.pop(0) if pp > 1 else 0
        e = rest.pop(0) if ep > 1 else 0
        files[(p, e, t)] = path / "model_optim_rng.pt"
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
               + (f"_{e:03d}" if ep > 1 else "")
               for p in range(pp) for e in range(ep) for t in range(tp)
               if (p, e, t) not in files]  # fmt: skip
    if missing:
        raise FileNotFoundError(f"{directory}: missing rank folders {', '.join(missing)}")
    return args, files


def global_expert_name(key: str, ep_rank: int, local_experts: int) -> str:
    """A legacy file's expert key under the expert's global number (each EP rank numbers
    its local experts from 0)."""
    match = _LOCAL_EXPERT.match(key)
    if match is None:
        return key
    index = ep_rank * local_experts + int(match.group(2))
    return f"{match.group(1)}{index}.{match.group(3)}"


def legacy_name(key: str, ep_rank: int, local_experts: int) -> str:
    """A legacy file's key under the names torch_dist gives it: an expert's global number,
    a GPT model's multi-token prediction layer as transformer_layer, a Mamba mixer's
    conv1d_weight / conv1d_bias as conv1d.weight / .bias (the stage's layer numbers are
    the caller's)."""
    name = global_expert_name(key, ep_rank, local_experts)
    name = _MTP_MODEL_LAYER.sub(r"\1transformer_layer.", name)
    return _LEGACY_CONV.sub(r".mixer.conv1d.\1", name)


def _read_torch(directory: Path, iteration: int) -> MegatronModel:
    args, files = legacy_rank_files(directory)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    local_experts = (getattr(args, "num_experts", None) or 0) // ep
    swiglu = gated(args)
    down_rows = latent_rows(args)
    parts = mamba_parts(args)
    checkpoint_version = None
    tensors = MegatronTensors()
    mapped = _MappedRankFiles()
    offset = 0
    for stage in range(pp):
        stage_layers: set[int] = set()
        for e in range(ep):
            paths = [files[(stage, e, t)] for t in range(tp)]
            shapes = [_meta_shapes(path) for path in paths]  # per TP rank
            versions = [s.pop("checkpoint_version") for s in shapes]
            checkpoint_version = versions[0]
            stage_layers |= {int(m.group(1)) for k in shapes[0] if (m := _LAYER.match(k))}
            for key in shapes[0]:
                expert = _LOCAL_EXPERT.match(key) is not None
                if e > 0 and not expert:
                    continue  # every EP rank holds the same copy of what is not an expert
                if stage > 0 and key.startswith("embedding."):
                    continue  # the last stage's copy of the first stage's embedding
                if _GROUPED_EXPERT.search(key):
                    raise ValueError(
                        f"{paths[0]}: {key}: Transformer Engine's grouped experts in the legacy "
                        "format are not imported; save with --ckpt-format torch_dist"
                    )
                pieces = [s.get(key) for s in shapes]
                if any(p is None for p in pieces):
                    raise ValueError(f"{directory}: {key} is missing on some TP ranks")
                name = legacy_name(key, e, local_experts)
                match = _LAYER.match(name)
                if match:
                    name = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
                whole = whole_rows(key, down_rows)
                joined = join_pieces(key, pieces, swiglu, whole, parts)
                read = functools.partial(_read_rank_tensor, mapped, paths, key, swiglu, whole,
                                         parts)  # fmt: skip
                tensors.add(name, joined.shape, joined.dtype, read)
        offset += len(stage_layers)
    return MegatronModel(directory, iteration, args, "torch", tensors, checkpoint_version)


def _meta_shapes(path: Path) -> dict:
    """{key: meta tensor} of a legacy file's model, and its checkpoint_version."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    state = safe_load(path, mmap=True)  # nothing is paged in but the pickle
    if "model" not in state:
        keys = sorted(k for k in state if re.fullmatch(r"model\d+", str(k)))
        reason = "virtual pipeline stages (model0, model1, ...)" if keys else "no 'model'"
        raise ValueError(f"{path}: {reason}: not imported")
    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
              for k, v in state["model"].items()
              if isinstance(v, torch.Tensor) and "_extra_state" not in k}  # fmt: skip
    return shapes | {"checkpoint_version": state.get("checkpoint_version")}


class _MappedRankFiles:
    """The models of one group of TP ranks' files, mapped (nothing is paged in but the
    pickles), kept from one tensor's read to the next: the tensors of one pipeline
    stage are read one after another, and each file's pickle, which names all its
    tensors, is parsed once for them rather than once each. Another group's read
    closes the mappings held.

    A page read through a mapping stays in the process's memory while the mapping
    lives, so `release` gives back, once a tensor is copied out, the pages of the
    pieces it was read from (Linux: madvise MADV_DONTNEED; the mapping is private and
    never written, so a later read pages them in from the file again). Only pages that
    /proc/self/maps shows mapped from the piece's own file are given back: memory of
    the process's own (a file in torch's old format, read whole) would be zeroed.
    Elsewhere the pages stay until the group's mappings close."""

    def __init__(self) -> None:
        self._paths: list[Path] = []
        self._models: list[dict] = []
        self._spans: list[list[tuple[int, int]]] = []  # each file's mapped address ranges

    def models(self, paths: list[Path]) -> list[dict]:
        """The files' models, in the order of `paths`."""
        if paths != self._paths:
            self._paths, self._models = [], []  # the old mappings go first
            self._models = [safe_load(path, mmap=True)["model"] for path in paths]
            self._spans = _file_mappings(paths) if _MADVISE is not None else []
            self._paths = list(paths)
        return self._models

    def release(self, pieces: list[torch.Tensor]) -> None:
        """Gives back the pages of `pieces`, one per file of the last `models(paths)`."""
        if _MADVISE is None:
            return
        page = mmap.PAGESIZE
        for piece, spans in zip(pieces, self._spans, strict=True):
            storage = piece.untyped_storage()
            start = storage.data_ptr() // page * page
            end = storage.data_ptr() + storage.nbytes()
            if any(low <= start and end <= high for low, high in spans):
                _MADVISE(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


_MADV_DONTNEED = 4  # Linux's value
_MADVISE = ctypes.CDLL(None).madvise if sys.platform == "linux" else None


def _file_mappings(paths: list[Path]) -> list[list[tuple[int, int]]]:
    """For each file, the address ranges /proc/self/maps shows mapped from it."""
    wanted = {os.path.realpath(path): i for i, path in enumerate(paths)}
    spans: list[list[tuple[int, int]]] = [[] for _ in paths]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") in wanted:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                spans[wanted[fields[5].rstrip("\n")]].append((low, high))
    return spans


def _read_rank_tensor(
    mapped: _MappedRankFiles, paths: list[Path], key: str, swiglu: bool,
    whole: int | None = None, parts=None,
) -> torch.Tensor:  # fmt: skip
    """One tensor joined from the TP ranks' files (mapped: only its pages are read)."""
    pieces = [model[key] for model in mapped.models(paths)]
    joined = join_pieces(key, pieces, swiglu, whole, parts)
    if any(joined.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
           for p in pieces):  # fmt: skip
        joined = joined.clone()  # a view of a mapped file: a tensor of its own
    mapped.release(pieces)
    return joined
