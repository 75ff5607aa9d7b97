"""Benchmark: `mp-ckpt import-megatron` peak memory and time on a ~1B-parameter checkpoint.

A synthetic Megatron-LM checkpoint of a Llama-style model (hidden 2048, 16
layers, 32 heads in 8 query groups, SwiGLU ffn 8192, vocabulary 32000, untied
output layer, RMSNorm, RoPE, no biases: 1.10B parameters, fp32, 4.1 GiB) is
written in Megatron's on-disk layout without Megatron, in both formats:

- torch_dist, TP1: one torch.distributed.checkpoint folder (single-process
  save, one __0_0.distcp), Megatron's key names with the layers stacked in a
  leading dimension and stored one chunk per layer (SwiGLU fc1: gate and up
  chunks), the norms under TE's names, common_state/shard_0_1 (the pickled
  args, an argparse.Namespace), metadata.json;
- legacy torch, TP2: iter_XXXXXXX/mp_rank_0{0,1}/model_optim_rng.pt, each the
  rank's TP-local pieces (QKV by query group, fc1 as [gate_r; up_r],
  proj / fc2 by columns, embedding / output by vocabulary rows).

Each is imported by `python -m mp_ckpt.cli import-megatron SRC OUT` in a
subprocess (measure megatron_import_peak_rss, one line per format), and its
peak RSS taken from getrusage(RUSAGE_CHILDREN) once it exits, as bench_ckpt.py
does. The baseline is the fixed overhead: the peak RSS of a process that
imports torch and mp_ckpt and does nothing. Target: peak - overhead <= 1.5 x
the largest Megatron tensor + one output piece (the largest logical tensor
written). The time is reported beside a copy of the source files to another
folder (shutil.copytree: the same bytes read and written); the source was just
written, so both may read from the page cache. One imported tensor (layer 0's
K of the fused QKV) and the word embedding are checked against the source.

    uv run python ci/bench/bench_megatron_import.py [--dir DIR] [--layers 16]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from harness import context, emit, peak_rss
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from mp_ckpt import CheckpointReader

MIB = 2**20
TARGET = 1.5
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 2048, 32, 8, 64, 8192, 32000
ITERATION = 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="work folder (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    ctx = context()
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        work = Path(work)
        baseline_kib, _ = peak_rss([sys.executable, "-c", "import torch, mp_ckpt"])
        for fmt, write in (("torch_dist", _write_torch_dist), ("torch", _write_torch_tp2)):
            source = work / f"megatron_{fmt}"
            write(source, args.layers)
            _measure(fmt, source, work, args.layers, baseline_kib * 1024, ctx)
            shutil.rmtree(source)


# --- the model ---------------------------------------------------------------------------


def _megatron_args(layers: int) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, seq_length=2048,
        max_position_embeddings=2048, padded_vocab_size=VOCAB, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, params_dtype=torch.float32,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    )  # fmt: skip


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    """One layer's tensors under Megatron's (legacy) names."""
    return {
        "input_layernorm.weight": (HIDDEN,),
        "self_attention.linear_qkv.weight": (GROUPS * (HEADS // GROUPS + 2) * HEAD_DIM, HIDDEN),
        "self_attention.linear_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "pre_mlp_layernorm.weight": (HIDDEN,),
        "mlp.linear_fc1.weight": (2 * FFN, HIDDEN),
        "mlp.linear_fc2.weight": (HIDDEN, FFN),
    }


_GLOBAL = {
    "embedding.word_embeddings.weight": (VOCAB, HIDDEN),
    "decoder.final_layernorm.weight": (HIDDEN,),
    "output_layer.weight": (VOCAB, HIDDEN),
}
# torch_dist names the local spec's norms as TE's fused ones.
_DIST_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _tensor(name: str, shape) -> torch.Tensor:
    """The whole tensor `name` (legacy name, one layer), the same in every format."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape).uniform_(-0.05, 0.05, generator=generator)


def _common(layers: int) -> dict:
    return {"args": _megatron_args(layers), "checkpoint_version": 3.0, "iteration": ITERATION}


def _tracker(root: Path) -> Path:
    directory = root / f"iter_{ITERATION:07d}"
    directory.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return directory


# --- torch_dist ----------------------------------------------------------------------------


class _ChunkedPlanner(DefaultSavePlanner):
    """Saves each key as the chunks Megatron writes (one per layer; SwiGLU fc1 as gate and
    up), each made when the writer asks for it."""

    def __init__(self, chunks: dict, produce) -> None:
        super().__init__()
        self.chunks, self.produce = chunks, produce

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, io.BytesIO):
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                continue
            properties = TensorProperties(dtype=value.dtype)
            for i, (offsets, sizes) in enumerate(self.chunks[fqn]):
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets), i), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=properties,
                                                size=value.size()),
                ))  # fmt: skip
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return self.state_dict[write_item.index.fqn]
        chunk = write_item.tensor_data.chunk
        return self.produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))


class _Writer(dcp.FileSystemWriter):
    """Records the checkpoint folder as a str, as Megatron's writer does (a pathlib.Path
    in .metadata is a global mp-ckpt's unpickler refuses)."""

    def storage_meta(self):
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = str(meta.checkpoint_id)
        return meta


def _write_torch_dist(root: Path, layers: int) -> None:
    directory = _tracker(root)
    state: dict[str, object] = {}
    chunks: dict[str, list] = {}
    for rest, shape in _layer_shapes().items():
        key = "decoder.layers." + _DIST_NAMES.get(rest, rest)
        state[key] = torch.empty((layers, *shape), device="meta")
        if rest == "mlp.linear_fc1.weight":  # gate and up: two chunks per layer
            half = (1, shape[0] // 2, *shape[1:])
            chunks[key] = [c for i in range(layers) for c in
                           (((i, 0, 0), half), ((i, shape[0] // 2, 0), half))]  # fmt: skip
        else:
            zeros = (0,) * len(shape)
            chunks[key] = [((i, *zeros), (1, *shape)) for i in range(layers)]
    for key, shape in _GLOBAL.items():
        state[key] = torch.empty(shape, device="meta")
        chunks[key] = [((0,) * len(shape), shape)]
    common = io.BytesIO()
    torch.save([_common(layers)], common)
    common.seek(0)
    state["common_state/shard_0_1"] = common
    legacy = {"decoder.layers." + _DIST_NAMES.get(r, r): r for r in _layer_shapes()}

    def produce(key: str, offsets, sizes) -> torch.Tensor:
        if key in _GLOBAL:
            return _tensor(key, sizes)
        layer, rest = offsets[0], legacy[key]
        whole = _tensor(f"decoder.layers.{layer}.{rest}", _layer_shapes()[rest])
        rows = slice(offsets[1], offsets[1] + sizes[1]) if len(sizes) > 1 else slice(None)
        return whole[rows].unsqueeze(0).contiguous()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=_Writer(directory, thread_count=1),
                 planner=_ChunkedPlanner(chunks, produce), no_dist=True)  # fmt: skip
    (directory / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )


# --- legacy torch, TP2 ---------------------------------------------------------------------


def _tp_piece(rest: str, whole: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if rest == "self_attention.linear_qkv.weight":
        return whole.reshape(GROUPS, -1, HIDDEN).chunk(tp)[rank].reshape(-1, HIDDEN).clone()
    if rest == "mlp.linear_fc1.weight":
        gate, up = whole.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return whole.chunk(tp, dim=1)[rank].clone()
    if rest in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return whole.chunk(tp)[rank].clone()
    return whole  # norms: whole on every rank


def _write_torch_tp2(root: Path, layers: int, tp: int = 2) -> None:
    directory = _tracker(root)
    for rank in range(tp):
        model: dict[str, torch.Tensor | None] = {}
        for key, shape in _GLOBAL.items():
            model[key] = _tp_piece(key, _tensor(key, shape), rank, tp)
        for i in range(layers):
            for rest, shape in _layer_shapes().items():
                name = f"decoder.layers.{i}.{rest}"
                model[name] = _tp_piece(rest, _tensor(name, shape), rank, tp)
                if "linear_" in rest:
                    model[name.rsplit(".", 1)[0] + "._extra_state"] = None
        args = _megatron_args(layers)
        args.tensor_model_parallel_size = tp
        state = {**_common(layers), "args": args, "model": model}
        folder = directory / f"mp_rank_{rank:02d}"
        folder.mkdir()
        torch.save(state, folder / "model_optim_rng.pt")
        del state, model


# --- the measure ---------------------------------------------------------------------------


def _measure(fmt: str, source: Path, work: Path, layers: int, baseline: int, ctx) -> None:
    megatron = {**_GLOBAL, **{f"decoder.layers.0.{r}": s for r, s in _layer_shapes().items()}}
    nbytes = {k: 4 * torch.Size(s).numel() for k, s in megatron.items()}
    largest_key = max(nbytes, key=nbytes.__getitem__)
    largest = nbytes[largest_key]
    # Output pieces: the logical tensors (whole); the largest is the word embedding.
    piece = 4 * VOCAB * HIDDEN
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    out = work / f"mp_{fmt}"
    command = ["import-megatron", str(source), str(out)]
    peak_kib, seconds = peak_rss([sys.executable, "-m", "mp_ckpt.cli", *command])
    peak = peak_kib * 1024

    reader = CheckpointReader(out)
    qkv = _tensor("decoder.layers.0.self_attention.linear_qkv.weight",
                  _layer_shapes()["self_attention.linear_qkv.weight"])  # fmt: skip
    k = qkv.reshape(GROUPS, HEADS // GROUPS + 2, HEAD_DIM, HIDDEN)[:, HEADS // GROUPS]
    equal = torch.equal(reader.read("decoder.layers.0.self_attention.linear_qkv.k.weight"), k)
    name = "embedding.word_embeddings.weight"
    embedding = _tensor(name, _GLOBAL[name])
    equal = equal and torch.equal(reader.read(name), embedding)
    parameters = sum(torch.Size(reader.shape(key)).numel() for key in reader.keys)
    del reader, qkv, k, embedding
    shutil.rmtree(out)

    copy = work / f"copy_{fmt}"
    start = time.perf_counter()
    shutil.copytree(source, copy)
    copy_s = time.perf_counter() - start
    shutil.rmtree(copy)

    limit = TARGET * largest + piece
    emit(
        "megatron_import_peak_rss",
        {
            "format": fmt,
            "tensor_model_parallel_size": 1 if fmt == "torch_dist" else 2,
            "parameters": parameters,
            "checkpoint_mib": round(total / MIB, 1),
            "peak_rss_mib": round(peak / MIB, 1),
            "fixed_overhead_rss_mib": round(baseline / MIB, 1),
            "peak_above_overhead_mib": round((peak - baseline) / MIB, 1),
            "largest_tensor": largest_key,
            "largest_tensor_mib": round(largest / MIB, 1),
            "largest_output_piece_mib": round(piece / MIB, 1),
            "limit_mib": round(limit / MIB, 1),
            "ratio": round((peak - baseline) / largest, 3),
            "meets_target": peak - baseline <= limit,
            "import_s": round(seconds, 2),
            "copy_baseline_s": round(copy_s, 2),
            "time_ratio": round(seconds / copy_s, 2),
            "imported_equal": equal,
            "import_command": "mp-ckpt " + " ".join(command).replace(str(work), "$WORK"),
            "ratio_means": "(peak - fixed overhead) / largest Megatron tensor; target: "
            "peak - overhead <= 1.5 x largest tensor + largest output piece",
        },
        ctx,
    )


if __name__ == "__main__":
    main()
