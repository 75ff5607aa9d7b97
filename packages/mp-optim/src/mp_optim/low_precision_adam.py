"""AdamW whose moments are stored in a lower precision (Megatron-LM's precision-aware
optimizer: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16).

    optimizer = LowPrecisionAdamW(groups, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16, lr=..., ...)

exp_avg and exp_avg_sq are kept in their dtypes (bf16: half of Adam's 8 bytes a
parameter); each step computes in fp32, as Transformer Engine's FusedAdam does: the
moments of a piece of the parameters are widened to fp32, torch's fused AdamW updates them
with the fp32 main parameters, and they are rounded back (to nearest). The pieces hold
at most CHUNK_ELEMENTS elements (small parameters together, large ones cut into ranges),
so the fp32 copies never cost more than 2 x 4 x CHUNK_ELEMENTS bytes at once; each piece
steps from a copy of its parameter's step count, and the counts advance once a step. A
moment kept in fp32 is updated in place, as by torch.optim.AdamW (with both in fp32 the
step is torch's fused AdamW's exactly).

load_state_dict keeps the moments in their dtypes (torch's would cast them to the
parameters' fp32).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.optim.adam import adam

__all__ = ["CHUNK_ELEMENTS", "LowPrecisionAdamW"]

CHUNK_ELEMENTS = {"cpu": 2**20, "cuda": 2**26}
"""At most this many elements' moments are widened to fp32 at once, per device type. On a
CPU the copies (8 MiB) stay in the cache between the widening, the update and the rounding
(ci/bench/bench_moment_dtypes.py: 2^20 and 2^18 took 94-95 ms a step over 50M parameters,
2^16 151 ms, 2^26 175 ms); on a GPU the pieces are few (each is a few kernel launches)
and their copies bounded (512 MiB). Another device takes the GPU's."""


class LowPrecisionAdamW(torch.optim.AdamW):
    def __init__(self, params, *, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
                 **kwargs) -> None:  # fmt: skip
        super().__init__(params, **kwargs)
        self.dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def init_moments(self, param: torch.Tensor) -> dict:
        """param's state as the first step creates it: the step and zero moments."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            for name, dtype in self.dtypes.items():
                state[name] = torch.zeros_like(param, dtype=dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LowPrecisionAdamW.step takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("LowPrecisionAdamW has neither amsgrad nor maximize")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.init_moments(p) for p in params]
            beta1, beta2 = group["betas"]
            kind = params[0].device.type
            limit = CHUNK_ELEMENTS[kind if kind in CHUNK_ELEMENTS else "cuda"]
            for piece in _pieces(params, states, limit):
                wide = {name: [t.float() for t in piece[name]] for name in self.dtypes}
                # each piece steps from a copy of its parameter's count (a parameter cut
                # into pieces counts one step, below)
                counts = [step.clone() for step in piece["step"]]
                adam(piece["param"], piece["grad"], wide["exp_avg"], wide["exp_avg_sq"], [],
                     counts, fused=True, decoupled_weight_decay=True, amsgrad=False,
                     beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False)  # fmt: skip
                for name, dtype in self.dtypes.items():
                    if dtype != torch.float32:  # (an fp32 moment was updated in place)
                        torch._foreach_copy_(piece[name], wide[name])
            torch._foreach_add_([s["step"] for s in states], 1.0)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name, dtype in self.dtypes.items():
                if name in state:
                    state[name] = state[name].to(dtype)


def _pieces(params: list[torch.Tensor], states: list[dict], limit: int) -> Iterator[dict]:
    """Flat pieces of the parameters, their gradients, moments and step counts, at most
    `limit` elements a batch: small parameters together, a large one cut into ranges."""
    batch: dict[str, list] = {k: [] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "step")}
    size = 0
    for p, state in zip(params, states, strict=True):
        flat = {"param": p.view(-1), "grad": p.grad.view(-1), "exp_avg": state["exp_avg"].view(-1),
                "exp_avg_sq": state["exp_avg_sq"].view(-1)}  # fmt: skip
        for start in range(0, p.numel(), limit):
            stop = min(start + limit, p.numel())
            if batch["param"] and size + stop - start > limit:
                yield batch
                batch, size = {k: [] for k in batch}, 0
            for name, tensor in flat.items():
                batch[name].append(tensor[start:stop])
            batch["step"].append(state["step"])
            size += stop - start
    if batch["param"]:
        yield batch
