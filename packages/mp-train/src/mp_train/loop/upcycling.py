"""A MoE run started from a dense model's checkpoint (moe_use_upcycling; Megatron-LM's
sparse upcycling, and its granular form, arXiv:2410.07524).

    upcycle_and_save(run, checkpointer)   the MoE model filled from the dense checkpoint
                                          the run starts from, saved at iteration 1

Every tensor the two models share (embeddings, attention, norms, the dense layers' MLPs)
loads as it is. A MoE layer's experts come from that layer's dense MLP: with
granularity G (moe_upcycling_granularity) the dense MLP's ffn_hidden_size F is cut into G
slices of moe_ffn_hidden_size F / G, and expert j holds slice j mod G: linear_fc1's rows
(gate and up apart) and linear_fc2's columns of the slice, linear_fc1's bias slice, and
linear_fc2's whole bias. Both weights are multiplied by s so that the layer computes
what the dense MLP did: the top-k probabilities of the G experts of one dense MLP sum to
1 / G without pre-softmax routing (to k / (E G) with it, E experts), so the experts'
output must grow by a = G (a = E G / k); an MLP whose output grows as the cube of its
weights (gated, squared ReLU) takes s = a^(1/3), one growing as their square (GELU) s =
a^(1/2). The router keeps its own initialization, its first E / G rows each repeated G
times, so that the G experts of one dense MLP are chosen together. Megatron-LM's rules
and scales (upcycling_utils.py); the result is the dense model's function exactly for G
= 1, and for any G with squared ReLU.

What the MoE layer has beyond the experts and the router (shared experts, the router's
expert bias) keeps its initialization, as in Megatron-LM. Each rank reads the dense
MLP tensors of its MoE layers whole, in CPU memory (fp32), then cuts its experts' pieces
from them.
"""

from __future__ import annotations

import logging
import re

import torch

from mp_ckpt import (
    Checkpointer,
    CheckpointReader,
    ShardedTensor,
    is_hf_directory,
    load_checkpoint,
    read_tracker,
)
from mp_train.loop.checkpointing import model_only_loaded, run_pieces, save_run_checkpoint
from mp_train.loop.setup import Run, TrainState
from mp_train.loop.starting_point import starting_point

__all__ = [
    "expert_box",
    "repeated_router",
    "upcycle_and_save",
    "upcycle_run_start",
    "weight_scale",
]

log = logging.getLogger("mp_train")

_EXPERT = re.compile(
    r"^(?P<mlp>.*\.mlp\.)experts\.(?P<name>linear_fc1(?:\.gate|\.up)?|linear_fc2)\."
    r"(?P<kind>weight|bias)$"
)
_ROUTER = re.compile(r"\.mlp\.router\.weight$")
_MOE_ONLY = re.compile(r"\.mlp\.(router|shared_experts|experts)\.")


def upcycle_and_save(run: Run, checkpointer: Checkpointer) -> str:
    """moe_use_upcycling: the dense checkpoint the run starts from (load, else
    pretrained_checkpoint), turned into the run's MoE model and saved at iteration 1 under
    `save`, which must not hold a checkpoint yet (Megatron-LM's rule: only the first run
    upcycles). Returns the dense checkpoint's directory."""
    ckpt = run.config.checkpoint
    if read_tracker(ckpt.save) is not None:
        raise ValueError(
            f"moe_use_upcycling: {ckpt.save} already holds a checkpoint; upcycling is for "
            "the first run only: resume from it without --moe-use-upcycling"
        )
    start = starting_point(ckpt)
    if start is None:
        where = ckpt.load if ckpt.load is not None else ckpt.pretrained_checkpoint
        raise ValueError(f"moe_use_upcycling: no checkpoint under {where} to upcycle")
    path = start[0]
    if is_hf_directory(path):
        raise ValueError(
            f"moe_use_upcycling: {path} is a Hugging Face directory; convert it with "
            "`mp-ckpt import-hf` first and upcycle the mp checkpoint it writes"
        )
    upcycle_run_start(run, path)
    save_run_checkpoint(run, checkpointer)
    return path


def upcycle_run_start(run: Run, path: str) -> None:
    """Fills the run's MoE model from the dense checkpoint under `path` (collective) and
    sets the run at iteration 1, as Megatron-LM does, its floating-point operations the
    dense run's."""
    model = run.config.model
    granularity = run.config.training.moe_upcycling_granularity
    scale = weight_scale(model, granularity)
    pieces = run_pieces(run, with_optimizer=False)
    reader = CheckpointReader(path, iteration=run.config.checkpoint.ckpt_step)
    directory, saved = reader.directory, reader.metadata["tensors"]
    direct, experts, routers, dense = {}, {}, [], {}
    for key, piece in pieces.items():
        match = _EXPERT.match(key)
        if match:
            name, kind = match["name"], match["kind"]
            dense_key = f"{match['mlp']}{name}.{kind}"
            if dense_key not in saved:
                raise ValueError(
                    f"moe_use_upcycling: {directory} holds no {dense_key} for {key}: not "
                    "the checkpoint of a dense model with this model's layers"
                )
            shape = tuple(saved[dense_key]["shape"])
            _check_width(piece, name, kind, dense_key, shape, granularity)
            dense.setdefault(dense_key, ShardedTensor(dense_key, torch.empty(shape), shape,
                                                      (0,) * len(shape)))  # fmt: skip
            experts[key] = (piece, name, kind, dense_key)
        elif _ROUTER.search(key):
            routers.append(piece)
        elif not _MOE_ONLY.search(key):
            direct[key] = piece
    loaded = load_checkpoint(path, {**direct, **dense}, iteration=run.config.checkpoint.ckpt_step,
                             finetune=True)  # fmt: skip
    for piece, name, kind, dense_key in experts.values():
        box = expert_box(piece, name, kind, dense[dense_key].data, granularity, scale)
        _fill(piece, box)
    for piece in routers if granularity > 1 else ():  # at 1 the router stays as drawn
        _fill(piece, repeated_router(piece, granularity))
    model_only_loaded(run, pieces)
    flops = loaded.common.get("train_state", {}).get("floating_point_operations_so_far", 0.0)
    run.train = TrainState(iteration=1, floating_point_operations_so_far=flops)
    if run.is_first_rank:
        log.info("upcycled the dense model %s into %d experts per MoE layer (granularity %d, "
                 "expert weights x %.4g); the run stands at iteration 1", loaded.directory,
                 model.num_moe_experts, granularity, scale)  # fmt: skip


def weight_scale(model, granularity: int) -> float:
    """s of the module docstring, for the model's routing and activation (Megatron-LM's
    _get_weight_scale)."""
    if model.gated_linear_unit and model.quick_geglu:
        raise ValueError(
            "moe_use_upcycling scales the experts for GELU, SwiGLU and squared ReLU MLPs; "
            "quick GeGLU is not one of them (Megatron-LM refuses it too)"
        )
    experts, topk = model.num_moe_experts, model.moe_router_topk
    growth = experts * granularity / topk if model.moe_router_pre_softmax else granularity
    cubic = model.gated_linear_unit or model.activation == "squared_relu"
    return growth ** (1 / 3) if cubic else growth ** (1 / 2)


def _check_width(piece: ShardedTensor, name: str, kind: str, dense_key: str, shape,
                 granularity: int) -> None:  # fmt: skip
    """The dense MLP's width is granularity x the experts' (moe_ffn_hidden_size)."""
    if name == "linear_fc2" and kind == "bias":
        return
    axis = 1 if name == "linear_fc2" else 0  # the ffn axis of the dense tensor
    width = piece.global_shape[axis + 1]
    dense_width = shape[axis]
    if dense_width != width * granularity:
        raise ValueError(
            f"moe_use_upcycling: the dense {dense_key} is {dense_width} wide, not "
            f"moe_upcycling_granularity={granularity} x moe_ffn_hidden_size={width}: give "
            f"--moe-ffn-hidden-size {dense_width // granularity} (or another granularity)"
        )


def _box(piece: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The piece's box in its logical tensor: (offset, shape)."""
    return piece.global_offset, tuple(piece.local_shape or piece.data.shape)


def expert_box(piece: ShardedTensor, name: str, kind: str, dense: torch.Tensor,
                granularity: int, scale: float) -> torch.Tensor:  # fmt: skip
    """The values of an expert piece's box: for each of its experts, its slice of the
    dense tensor (scaled), or the dense linear_fc2 bias as it is."""
    (first, *inner), (count, *sizes) = _box(piece)
    if name == "linear_fc2" and kind == "bias":
        return dense.expand(count, *dense.shape).clone()
    axis = 1 if name == "linear_fc2" else 0  # the ffn axis of the dense tensor
    width = dense.shape[axis] // granularity
    boxes = []
    for expert in range(first, first + count):
        start = (expert % granularity) * width + inner[axis]
        boxes.append(dense.narrow(axis, start, sizes[axis]) * scale)
    box = torch.stack(boxes)
    if name == "linear_fc2":  # the hidden axis: whole unless the piece holds a part of it
        box = box.narrow(1, inner[0], sizes[0])
    return box


def repeated_router(piece: ShardedTensor, granularity: int) -> torch.Tensor:
    """The router's weight [E, h] with its first E / G rows each repeated G times
    (G > 1)."""
    if piece.flattened_range is not None and granularity > 1:
        raise ValueError(
            f"moe_upcycling_granularity={granularity} under ZeRO-2/3: this rank holds a part "
            f"of {piece.key} and the router's rows repeat across parts; upcycle without "
            "FSDP (the converted checkpoint resumes under it)"
        )
    kept = piece.data.detach().float().cpu().tensor_split(granularity, dim=0)[0]
    return kept.repeat_interleave(granularity, dim=0)


def _fill(piece: ShardedTensor, box: torch.Tensor) -> None:
    """Copies a box's values into the piece (its flattened range under FSDP)."""
    if piece.flattened_range is not None:
        start, end = piece.flattened_range
        box = box.reshape(-1)[start:end]
    with torch.no_grad():
        piece.data.copy_(box.reshape(piece.data.shape))
