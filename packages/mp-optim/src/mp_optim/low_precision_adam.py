"""AdamW whose moments are stored in a lower precision (Megatron-LM's precision-aware
optimizer: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16).

    optimizer = LowPrecisionAdamW(groups, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16, lr=..., ...)

exp_avg and exp_avg_sq are kept in their dtypes (bf16: half of Adam's 8 bytes a
parameter); each step computes in fp32, as Transformer Engine's FusedAdam does: the
moments of a chunk of parameters are widened to fp32, torch's fused AdamW updates them
with the fp32 main parameters, and they are rounded back (to nearest). The chunks hold
at most CHUNK_ELEMENTS elements, so the fp32 copies never cost more than 2 x 4 x
CHUNK_ELEMENTS bytes at once. A moment kept in fp32 is updated in place, as by
torch.optim.AdamW (with both in fp32 the step is torch's fused AdamW's exactly).

load_state_dict keeps the moments in their dtypes (torch's would cast them to the
parameters' fp32).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.optim.adam import adam

__all__ = ["CHUNK_ELEMENTS", "LowPrecisionAdamW"]

CHUNK_ELEMENTS = 2**26
"""At most this many elements' moments are widened to fp32 at once (512 MiB of copies)."""


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
            for chunk in _chunks(params, CHUNK_ELEMENTS):
                states = [self.init_moments(p) for p in chunk]
                wide = {name: [s[name].float() for s in states] for name in self.dtypes}
                beta1, beta2 = group["betas"]
                adam(chunk, [p.grad for p in chunk], wide["exp_avg"], wide["exp_avg_sq"], [],
                     [s["step"] for s in states], fused=True, decoupled_weight_decay=True,
                     amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False)  # fmt: skip
                for name, dtype in self.dtypes.items():
                    if dtype != torch.float32:  # (an fp32 moment was updated in place)
                        torch._foreach_copy_([s[name] for s in states], wide[name])
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name, dtype in self.dtypes.items():
                if name in state:
                    state[name] = state[name].to(dtype)


def _chunks(params: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """params in consecutive runs of at most `limit` elements (one parameter alone when it
    is larger)."""
    chunk, size = [], 0
    for p in params:
        if chunk and size + p.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk
