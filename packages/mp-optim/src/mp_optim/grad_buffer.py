"""Contiguous gradient (and parameter) buffers, split into buckets.

One buffer per (parameter dtype, gradient dtype) pair holds the gradients of
its parameters end to end; each parameter's `.main_grad` is a view into it,
so the backward accumulates straight into the buffer and a data-parallel
reduction is one collective per bucket instead of one per parameter.

Parameters are laid out in the reverse of `module.parameters()` order, about
the order in which the backward produces their gradients, so that the first
buckets are complete first. A bucket closes once it holds at least
bucket_size elements (None: one bucket per buffer).

With the distributed optimizer every bucket is padded to a multiple of
lcm(dp, 128) elements and split into dp equal, contiguous shards: rank r owns
shard r of every bucket. The gradients are reduce-scattered (rank r receives
the sum of its shard), rank r updates its shard of the parameters, and the
shards are all-gathered back. For that the parameters live in a second
contiguous buffer with the same layout: each parameter's `.data` becomes a
view into it.

    buffer    | bucket 0                    | bucket 1               |
              | p5  | p4    | p3   | pad    | p2  | p1   | p0  | pad |
    dp = 2:   | shard 0      | shard 1      | shard 0    | shard 1    |

Expert-parallel parameters (`param.expert_parallel = True`, the routed
experts of a mixture-of-experts layer) never share a buffer with dense ones:
their gradients are reduced over another group (the expert data-parallel
group), so a buffer records which kind it holds and dp_size is the size of
the group that reduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "GradBuffer", "ParamRange"]


@dataclass(frozen=True)
class ParamRange:
    """Where a parameter sits in its buffer: elements [start, end)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class Bucket:
    """A contiguous slice [offset, offset + numel) of a buffer, reduced by one collective."""

    def __init__(self, buffer: GradBuffer, index: int, params: list[torch.nn.Parameter],
                 offset: int, numel: int) -> None:  # fmt: skip
        self.buffer = buffer
        self.index = index
        self.params = params
        self.offset = offset
        self.numel = numel
        self.grad_data = buffer.grad_data[offset : offset + numel]
        self.param_data = None
        if buffer.param_data is not None:
            self.param_data = buffer.param_data[offset : offset + numel]

    def shard(self, dp_rank: int, dp_size: int) -> ParamRange:
        """Rank dp_rank's shard of this bucket, in buffer coordinates."""
        size = self.numel // dp_size
        start = self.offset + dp_rank * size
        return ParamRange(start, start + size)

    def __repr__(self) -> str:
        return f"Bucket({self.index}, params={len(self.params)}, numel={self.numel})"


class GradBuffer:
    """The gradient buffer of parameters that share a dtype, and its buckets.

    Arguments:
        params: the parameters, in the order they are laid out (all one dtype).
        grad_dtype: dtype of the gradients (fp32 to accumulate bf16 gradients in fp32).
        bucket_size: elements per bucket (a bucket closes once it holds at least
            this many); None: one bucket.
        dp_size: size of the group that reduces the gradients; with shard_for_dp,
            buckets are padded to a multiple of lcm(dp_size, 128).
        shard_for_dp: lay out for the distributed optimizer: padded buckets and a
            parameter buffer holding the parameters' data.
        expert_parallel: the parameters are expert-parallel (reduced over the
            expert data-parallel group); recorded for the buffer's users.
    """

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, *,
                 bucket_size: int | None, dp_size: int, shard_for_dp: bool,
                 expert_parallel: bool = False) -> None:  # fmt: skip
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            names = sorted(map(str, dtypes))
            raise ValueError(f"one buffer holds one parameter dtype, got {names}")
        self.params = params
        self.expert_parallel = expert_parallel
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.device = params[0].device
        pad_to = math.lcm(dp_size, 128) if shard_for_dp else 1

        self.ranges: dict[torch.nn.Parameter, ParamRange] = {}
        bucket_params: list[list[torch.nn.Parameter]] = [[]]
        bucket_bounds: list[tuple[int, int]] = []
        start = bucket_start = 0

        def close() -> None:
            nonlocal start, bucket_start
            start = _round_up(start, pad_to)
            bucket_bounds.append((bucket_start, start))
            bucket_start = start
            bucket_params.append([])

        for param in params:
            # Sharded, a tied embedding's two copies (first and last pipeline stage) get a
            # bucket each of their own, as in Megatron-LM: laid out alike, the same dp rank
            # holds the same rows of both after the reduce-scatter, which the embedding
            # group's all-reduce then sums; in a shared bucket each copy's shard fell at
            # another offset, and rows reduced over dp were summed with unreduced ones.
            alone = shard_for_dp and getattr(param, "shared_embedding", False)
            if alone and bucket_params[-1]:
                close()
            self.ranges[param] = ParamRange(start, start + param.numel())
            start += param.numel()
            bucket_params[-1].append(param)
            if alone or (bucket_size is not None and start - bucket_start >= bucket_size):
                close()
        if bucket_params[-1]:
            close()
        bucket_params.pop()  # the empty bucket the last close() opened
        self.numel = start
        self.numel_unpadded = sum(p.numel() for p in params)

        factory = {"device": self.device}
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, **factory)
        self.param_data = None
        if shard_for_dp:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, **factory)
            for param, where in self.ranges.items():
                view = self.param_data[where.start : where.end].view_as(param)
                view.copy_(param.data)
                param.data = view
        for param, where in self.ranges.items():
            param.main_grad = self.grad_data[where.start : where.end].view(param.shape)

        self.buckets = [
            Bucket(self, i, group, lo, hi - lo)
            for i, (group, (lo, hi)) in enumerate(zip(bucket_params, bucket_bounds, strict=True))
        ]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}

    def reset(self) -> None:
        """Zeros the gradients (the start of a new global batch)."""
        self.grad_data.zero_()

    def __repr__(self) -> str:
        kind = ", expert" if self.expert_parallel else ""
        return (
            f"GradBuffer(params={len(self.params)}{kind}, {self.param_dtype} -> {self.grad_dtype}, "
            f"numel={self.numel}, buckets={len(self.buckets)})"
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
