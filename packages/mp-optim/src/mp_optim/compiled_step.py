"""AdamW's update compiled with the clipping's scale and the copy into the model
(OptimizerConfig.torch_compile_optimizer).

The plain step makes three passes over the main parameters after the gradient norm:
torch._foreach_mul_ scales the gradients by the clipping coefficient, torch's fused
AdamW updates the parameters and their moments, and a copy writes each fp32 main
parameter into the model's bf16 (or fp16) parameter. Compiled (torch.compile,
inductor; one graph for every size), one kernel per main parameter does all three,
reading the parameter, its gradient and both moments once and writing the parameter,
the moments and the model's copy once.

    adamw_step(optimizer, model_views, grad_scale, grad_scales=None)

`optimizer` is the torch AdamW the plain step would run: its param_groups (lr and
weight_decay, which the scheduler writes, betas, eps) and its state (step, exp_avg,
exp_avg_sq, created as its fused implementation creates them) are read and written
as it would, so checkpoints and a later plain step see the same optimizer.
`model_views` maps each main parameter to the model tensor it is copied into (None:
the main parameter is the model's own memory). `grad_scales` maps a main parameter to
another scale than grad_scale (a separate grad_norm_group's, clipped by its own norm
already: 1). The update is AdamW's (decoupled weight
decay, bias-corrected moments):

    g = grad x grad_scale;  p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p -= lr / (1 - b1^t) x m / (sqrt(v) / sqrt(1 - b2^t) + eps)

in fp32, 1 - b^t computed as -expm1(t log b); equal to torch's AdamW within fp32
rounding (test_fused_adam.py bounds it). The gradients are left unscaled.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["adamw_step"]


def adamw_step(
    optimizer: torch.optim.Optimizer,
    model_views: dict[int, torch.Tensor | None],
    grad_scale: float,
    grad_scales: dict[int, float] | None = None,
) -> None:
    """One AdamW step over every main parameter of `optimizer` that has a gradient,
    scaling the gradients by `grad_scale` (or grad_scales[id(p)]) on the way (see the
    module docstring)."""
    grad_scales = grad_scales or {}
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("the compiled AdamW step has neither amsgrad nor maximize")
        beta1, beta2 = group["betas"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        device = params[0].device
        # Values the scheduler and the clipping change every step: tensors, so that the
        # compiled graph is not specialized (and recompiled) on each new value.
        by_scale = {}
        for scale in {grad_scale, *(grad_scales.get(id(p), grad_scale) for p in params)}:
            values = [group["lr"], group["weight_decay"], scale]
            by_scale[scale] = torch.tensor(values, dtype=torch.float32).to(
                device, non_blocking=True
            )
        for p in params:
            state = optimizer.state[p]
            if not state:
                dtypes = getattr(optimizer, "dtypes", {})  # LowPrecisionAdamW's moments
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                for name in ("exp_avg", "exp_avg_sq"):
                    state[name] = torch.zeros_like(
                        p, dtype=dtypes.get(name, p.dtype), memory_format=torch.preserve_format
                    )
        torch._foreach_add_([optimizer.state[p]["step"] for p in params], 1.0)  # one launch
        for p in params:
            state = optimizer.state[p]
            flat = (p.view(-1), p.grad.reshape(-1), state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1))  # fmt: skip
            constants = (beta1, beta2, group["eps"])
            scalars = by_scale[grad_scales.get(id(p), grad_scale)]
            out = model_views.get(id(p))
            if out is None:
                _compiled(False)(*flat, state["step"], scalars, *constants)
            else:
                _compiled(True)(*flat, state["step"], scalars, *constants, out.view(-1))


def _update(param, grad, exp_avg, exp_avg_sq, step, scalars, beta1, beta2, eps):
    lr, weight_decay, grad_scale = scalars[0], scalars[1], scalars[2]
    g = grad * grad_scale
    param.mul_(1 - lr * weight_decay)
    # Moments stored in a lower precision (LowPrecisionAdamW's) are updated in fp32 and
    # rounded back; fp32 ones in place.
    stored_m, stored_v = exp_avg, exp_avg_sq
    exp_avg, exp_avg_sq = exp_avg.float(), exp_avg_sq.float()
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if stored_m.dtype != torch.float32:
        stored_m.copy_(exp_avg)
    if stored_v.dtype != torch.float32:
        stored_v.copy_(exp_avg_sq)
    # 1 - beta^t as -expm1(t log beta): the direct form cancels in fp32 (1 - 0.999^t
    # loses three of its seven digits); the logarithms are taken in fp64.
    bias_correction1 = -torch.expm1(step * math.log(beta1))
    bias_correction2_sqrt = (-torch.expm1(step * math.log(beta2))).sqrt()
    denominator = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.sub_(exp_avg / denominator * (lr / bias_correction1))


def _update_and_copy(param, grad, exp_avg, exp_avg_sq, step, scalars, beta1, beta2, eps, out):
    _update(param, grad, exp_avg, exp_avg_sq, step, scalars, beta1, beta2, eps)
    out.copy_(param)


@functools.cache
def _compiled(copy: bool):
    return torch.compile(_update_and_copy if copy else _update, dynamic=True)
