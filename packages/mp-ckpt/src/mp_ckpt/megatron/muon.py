"""Megatron-LM's Muon (--optimizer muon) in a training checkpoint, for import-megatron.

Megatron chains Muon's optimizer (the matrices) and Adam's (the embedding, the output
layer, norms, biases). In torch_dist without the distributed optimizer each matrix has
"optimizer.state.momentum_buffer.<model key>" in place of Adam's moments, and
common_state's "optimizer" is {0: Muon's, 1: Adam's} (in the order of the parameter
groups), each with its "param_groups"; Muon's groups carry "momentum" and no "betas",
and only Adam's part carries the step ("state": {"common_step": ...}). Megatron's Muon
has the decayed kind of group only (its parameters are matrices).

mp's Muon (mp_optim.muon_groups) splits each of its parameter groups into a Muon and an
Adam group: its optimizer's groups are Muon's, one per kind, then Adam's, one per kind,
in the kinds' order. chained_groups gives the imported groups that form, a kind one of
the two lacks taking the other's hyper-parameters.

Refused with the file and the setting: another optimizer (SGD, Lion, SOAP, adaptive
Muon), and Muon's state in the legacy format or with the distributed optimizer (then
Megatron's layer-wise optimizer, whose layout is not read).
"""

from __future__ import annotations

__all__ = ["chained_groups", "is_muon_part", "refuse_muon_layout"]

_ADAM_ONLY = ("betas", "eps")


def refuse_muon_layout(model) -> None:
    """Raises unless the run's optimizer state is Adam's, or Muon's beside Adam's in
    torch_dist without the distributed optimizer."""
    args = model.args
    optimizer = str(getattr(args, "optimizer", None) or "adam")
    if optimizer not in ("adam", "muon"):
        raise ValueError(f"{model.directory}: args optimizer={optimizer!r}: --with-optimizer "
                         "reads Adam's and Muon's state only; import the weights without "
                         "it")  # fmt: skip
    distributed = bool(getattr(args, "use_distributed_optimizer", False))
    if optimizer == "muon" and (model.format != "torch_dist" or distributed):
        layout = "the layer-wise distributed optimizer" if distributed else "legacy torch files"
        raise ValueError(f"{model.directory}: Muon's state in {layout} is not read (only "
                         "torch_dist without --use-distributed-optimizer); import the "
                         "weights without --with-optimizer")  # fmt: skip


def is_muon_part(part: dict) -> bool:
    """One optimizer's entry of common_state's chain is Muon's: its groups have a
    momentum and no Adam betas."""
    groups = part.get("param_groups") or []
    return bool(groups) and all("momentum" in g and "betas" not in g for g in groups)


def _kind(group: dict) -> tuple:
    return group["wd_mult"], group["lr_mult"], group.get("decoupled_lr", False)


def chained_groups(muon: list[dict], adam: list[dict], where: str) -> list[dict]:
    """mp's parameter groups under Muon from Megatron's Muon and Adam groups (each
    already in mp's form, one per kind): Muon's of every kind, then Adam's."""
    if not adam:
        raise ValueError(f"{where}: common_state: Muon's parameter groups without Adam's")
    kinds = sorted({_kind(g) for g in muon + adam})
    muon_by, adam_by = {_kind(g): g for g in muon}, {_kind(g): g for g in adam}
    momentum = muon[0]["momentum"]
    adam_only = {k: adam[0][k] for k in _ADAM_ONLY if k in adam[0]}
    out = []
    for kind in kinds:  # a kind Muon has no parameters of takes Adam's schedule
        group = muon_by.get(kind)
        if group is None:
            group = {k: v for k, v in adam_by[kind].items() if k not in _ADAM_ONLY}
            group["momentum"] = momentum
        out.append(group)
    for kind in kinds:
        group = adam_by.get(kind)
        if group is None:
            group = {k: v for k, v in muon_by[kind].items() if k != "momentum"} | adam_only
        out.append(group)
    return out
