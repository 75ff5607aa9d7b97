"""Which parameters count in the global gradient norm: not the replicas a parameter's
pieces mark (replica_id > 0: a norm weight on tensor-parallel ranks > 0, the last stage's
copy of a tied embedding), so that every logical element is counted once."""

from __future__ import annotations

import torch

from mp_optim.flat_ranges import locate

__all__ = ["counted_in_grad_norm", "counted_of"]


def counted_in_grad_norm(module: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters of `module` whose gradients count in the global norm.

    A parameter whose pieces in module.sharded_state_dict() all have
    replica_id > 0 is a copy of one counted elsewhere (a norm weight on
    tensor-parallel ranks > 0, the last stage's tied embedding) and is left
    out. Parameters the description does not mention, and every parameter of
    a module without sharded_state_dict, count.
    """
    params = list(module.parameters())
    describe = getattr(module, "sharded_state_dict", None)
    if describe is None:
        return set(params)
    return counted_of(locate(describe().values(), params), params)


def counted_of(located, params: list[torch.nn.Parameter]) -> set[torch.nn.Parameter]:
    """counted_in_grad_norm's rule over (piece, parameter, offset) triples: the parameters
    with a piece of replica_id 0, and those no piece describes."""
    described, counted = set(), set()
    for piece, param, _ in located:
        described.add(param)
        if piece.replica_id == 0:
            counted.add(param)
    return counted | (set(params) - described)
