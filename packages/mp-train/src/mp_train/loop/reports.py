"""The loss function's reports over a global batch: scalars (averaged over the
micro-batches) or [sum, count] pairs (summed, then divided), as Megatron's."""

from __future__ import annotations

import torch

__all__ = ["counted_nothing", "reduce_reports"]


def reduce_reports(reports: list[dict]) -> dict[str, float]:
    """Averages each reported value over micro-batches ([sum, count] pairs: sum / count)."""
    if not reports:
        return {}
    pairs, out = _pair_totals(reports), {}
    for name in reports[0]:
        if name in pairs:
            total, count = pairs[name].tolist()
            out[name] = total / count if count > 0 else float("nan")
        else:
            values = [torch.as_tensor(r[name]).detach().double().cpu() for r in reports]
            out[name] = float(torch.stack([v.reshape(()) for v in values]).mean())
    return out


def counted_nothing(reports: list[dict]) -> set[str]:
    """The reported [sum, count] values whose count over the global batch is 0 (and sum
    0: a nan there is a nan loss all the same), which reduce_reports makes nan."""
    return {name for name, total in _pair_totals(reports).items() if total.tolist() == [0, 0]}


def _pair_totals(reports: list[dict]) -> dict[str, torch.Tensor]:
    """Each reported [sum, count] pair summed over the micro-batches (float64, CPU)."""
    if not reports:
        return {}
    pairs = [name for name in reports[0] if torch.as_tensor(reports[0][name]).numel() == 2]
    return {name: torch.stack([torch.as_tensor(r[name]).detach().double().cpu().reshape(2)
                               for r in reports]).sum(0)
            for name in pairs}  # fmt: skip
