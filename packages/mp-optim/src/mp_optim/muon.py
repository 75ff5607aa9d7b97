"""Muon: momentum SGD whose update is orthogonalized by a Newton-Schulz iteration
(Megatron-LM's `--optimizer muon`, its TensorParallelMuon).

For each matrix parameter W with gradient G, every step:

    W <- W * (1 - lr * wd)                   decoupled weight decay (or G += wd * W, L2)
    M <- momentum * M + (1 - momentum) * G   the momentum buffer (an EMA)
    U <- M, or with Nesterov G + momentum * (M - G)
    W <- W - lr * NS(U) * scale(rows, cols) * extra_scale_factor

NS(U) = U / |U|_F pushed through `steps` odd quintic polynomials X <- aX + (bA + cA^2)X,
A = X X^T (on the smaller side of U), which drives every singular value towards 1. The
coefficient sets are the published ones (Muon's, Polar Express's, CANS's, AOL's,
DeepSeek-V4's), cycled or with the last repeated as Megatron does. With matmul precision
"medium" the iteration runs in bf16, as there; "high" keeps fp32 (TF32 on a GPU).

Parameters split over tensor-parallel ranks (a MatrixLayout's partition_dim and group, from
what mp_layers marks: muon_groups.py) are orthogonalized as the whole matrix, the same
at any TP size: "duplicated" all-gathers the update and runs NS on every rank,
"distributed" all-reduces the Gram matrix A each step instead, "blockwise" orthogonalizes
each rank's block alone (the result then depends on the TP size, as in Megatron).
A fused query/key/value weight (`qkv_rows` in its layout) is orthogonalized part by part
with split_qkv. A 3-D parameter (the local experts' [experts, out, in]) is a batch of
matrices, one per expert, as Megatron's per-expert weights are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, cycle, islice, repeat

import torch
import torch.distributed as dist

from mp_state import RankGroup

__all__ = [
    "COEFFICIENT_TYPES",
    "MatrixLayout",
    "Muon",
    "newton_schulz",
    "scale_factor",
]

# (a, b, c) of X <- aX + (b A + c A^2) X, step by step (values as published)
_COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
COEFFICIENT_TYPES = tuple(_COEFFICIENTS)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "distributed", "blockwise")
_PRECISIONS = ("medium", "high", "highest")


def _coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    if kind not in _COEFFICIENTS:
        raise ValueError(f"Newton-Schulz coefficient type {kind!r}: one of {COEFFICIENT_TYPES}")
    sets = _COEFFICIENTS[kind]
    endless = chain(sets, repeat(sets[-1])) if kind in _REPEAT_LAST else cycle(sets)
    return list(islice(endless, steps))


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficient_type: str = "quintic",
    *,
    group: RankGroup | None = None,
    transpose: bool | None = None,
    eps: float = 1e-7,
) -> torch.Tensor:
    """The orthogonalization of x ([rows, cols], or a batch [..., rows, cols]), fp32.

    With `group`, x is one rank's block of a matrix split over the group along the side
    the iteration contracts (columns, or rows with transpose=True): the norm and the Gram
    matrix A are summed over the group. The iteration runs in bf16 when torch's float32
    matmul precision is "medium" (Muon's matmul_precision sets it)."""
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got {x.dim()}-D")
    if x.dtype != torch.float32:
        raise TypeError(f"newton_schulz takes fp32, got {x.dtype}")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    split = group is not None and group.size > 1
    if split:  # the Frobenius norm of the whole matrix
        squares = (x * x).sum(dim=(-2, -1), keepdim=True)
        dist.all_reduce(squares, group=group.group)
        X = x / squares.sqrt().clamp_min(eps)
    else:
        X = torch.nn.functional.normalize(x, p=2.0, dim=(-2, -1), eps=eps)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in _coefficients(coefficient_type, steps):
        A = X @ X.mT
        if split:
            dist.all_reduce(A, group=group.group)
        if X.dim() == 2:
            B = torch.addmm(A, A, A, alpha=c, beta=b)
            X = torch.addmm(X, B, X, alpha=1.0, beta=a)
        else:
            B = torch.baddbmm(A, A, A, alpha=c, beta=b)
            X = torch.baddbmm(X, B, X, alpha=1.0, beta=a)
    X = X.float()
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The factor the orthogonalized update of a [rows, cols] matrix is scaled by:
    spectral sqrt(max(rows, cols)) (Kimi's, with extra_scale_factor 0.2 for Adam's update
    size), unit_rms_norm sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols))."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"Muon scale mode {mode!r}: one of {SCALE_MODES}")


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter's tensor holds its matrices."""

    partition_dim: int | None = None
    """The tensor dimension split over `group` (None: the whole matrix is here)."""
    group: RankGroup | None = None
    qkv_rows: tuple[int, ...] | None = None
    """A fused query/key/value weight: the rows of each part within one query group
    (q, [gate,] k, v); the rows hold the local query groups one after another."""

    @property
    def split(self) -> bool:
        return self.partition_dim is not None and self.group is not None and self.group.size > 1


class Muon(torch.optim.Optimizer):
    """Muon over matrix parameters (see the module docstring).

    `layouts` maps a parameter (by id) to its MatrixLayout; parameters without one are
    whole matrices (or batches of them) on this rank. Hyper-parameters a group sets
    (lr, weight_decay, momentum) win over the defaults, as in any torch optimizer."""

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        num_ns_steps: int = 5,
        coefficient_type: str = "quintic",
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        matmul_precision: str = "medium",
        tp_mode: str = "duplicated",
        split_qkv: bool = True,
        layouts: dict[int, MatrixLayout] | None = None,
    ) -> None:
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps={num_ns_steps}: at least 1")
        _coefficients(coefficient_type, 1)
        scale_factor(1, 1, scale_mode)
        if tp_mode not in TP_MODES:
            raise ValueError(f"Muon tp_mode {tp_mode!r}: one of {TP_MODES}")
        if matmul_precision not in _PRECISIONS:
            raise ValueError(f"Muon matmul precision {matmul_precision!r}: one of {_PRECISIONS}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.nesterov = nesterov
        self.decoupled_weight_decay = decoupled_weight_decay
        self.num_ns_steps = num_ns_steps
        self.coefficient_type = coefficient_type
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.matmul_precision = matmul_precision
        self.tp_mode = tp_mode
        self.split_qkv = split_qkv
        self.layouts = dict(layouts or {})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                if wd != 0.0 and self.decoupled_weight_decay:
                    p.add_(p, alpha=-wd * lr)
                elif wd != 0.0:
                    grad = grad.add(p, alpha=wd)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1.0 - beta)
                update = grad.lerp(buf, beta) if self.nesterov else buf
                p.add_(self.orthogonalize(p, update), alpha=-lr)

    def orthogonalize(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The scaled orthogonalization of `update`, the momentum of parameter p."""
        layout = self.layouts.get(id(p), MatrixLayout())
        with _matmul_precision(self.matmul_precision):
            if not (self.split_qkv and layout.qkv_rows):
                return self._scaled(update, layout)
            rows, cols = layout.qkv_rows, update.size(-1)
            batch = update.shape[:-2]
            grouped = update.reshape(*batch, -1, sum(rows), cols)
            parts = []
            for part in grouped.split(list(rows), dim=-2):
                flat = part.reshape(*batch, -1, cols)
                parts.append(self._scaled(flat, layout).view_as(part))
            return torch.cat(parts, dim=-2).view_as(update)

    def _scaled(self, x: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
        steps, kind = self.num_ns_steps, self.coefficient_type
        size = [x.size(-2), x.size(-1)]
        if not layout.split or self.tp_mode == "blockwise":
            out = newton_schulz(x, steps, kind)
        else:
            dim = layout.partition_dim % x.dim()
            group = layout.group
            size[dim - x.dim() + 2] *= group.size
            if self.tp_mode == "duplicated":
                blocks = [torch.empty_like(x) for _ in range(group.size)]
                dist.all_gather(blocks, x.contiguous(), group=group.group)
                whole = newton_schulz(torch.cat(blocks, dim=dim), steps, kind)
                out = whole.chunk(group.size, dim=dim)[group.rank]
            else:  # distributed: the split side is the one the Gram matrix sums over
                transpose = dim == x.dim() - 2
                out = newton_schulz(x, steps, kind, group=group, transpose=transpose)
        return out * scale_factor(*size, self.scale_mode) * self.extra_scale_factor


@contextlib.contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
