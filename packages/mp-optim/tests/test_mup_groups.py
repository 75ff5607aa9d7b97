"""muP's parameter groups (get_param_groups with mup_width_mult, Megatron-LM's
get_mup_config_overrides): under adam the hidden matrices' lr (both ends of the schedule)
and eps divided by the width multiplier; under sgd the vector-like parameters' lr times
it; under muon only the matrices Adam steps; a decoupled lr kept; a checkpoint of other
groups refused. The groups of a Megatron-LM muP run: tests/test_megatron_import_resume.py."""

from types import SimpleNamespace

import pytest
import torch

from mp_optim import OptimizerConfig, get_optimizer_param_scheduler, get_param_groups
from mp_optim.optimizer_state import _checked_hyper


def toy_model() -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """An embedding and an output layer (marked as a GPTModel marks them), a hidden matrix
    and its bias, a norm, and a hidden matrix Muon leaves to Adam (use_muon=False)."""
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(8, 4)
    model.hidden = torch.nn.Linear(4, 4)
    model.norm = torch.nn.LayerNorm(4, bias=False)
    model.gate = torch.nn.Linear(4, 1, bias=False)
    model.output = torch.nn.Linear(4, 8, bias=False)
    for weight in (model.embedding.weight, model.output.weight):
        weight.is_embedding_or_output_parameter = True
        weight.is_embedding_parameter = True
    model.gate.weight.use_muon = False
    return model, dict(model.named_parameters())


def grouped(config, width=2.0, **kw):
    model, named = toy_model()
    names = {id(p): n for n, p in named.items()}
    groups = get_param_groups([model], config, mup_width_mult=width, **kw)
    return [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]


def test_adam_divides_the_hidden_matrices_lr_and_eps():
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8, weight_decay=0.1)
    groups = grouped(config, width=4.0)
    assert [(g["wd_mult"], g.get("mup", False), g["params"]) for g in groups] == [
        (0.0, False, ["hidden.bias", "norm.weight"]),
        (1.0, False, ["embedding.weight", "output.weight"]),
        (1.0, True, ["hidden.weight", "gate.weight"]),
    ]
    mup = groups[2]
    assert (mup["max_lr"], mup["min_lr"], mup["eps"]) == (2.5e-4, 2.5e-5, 2.5e-9)
    assert not any(k in groups[1] for k in ("max_lr", "min_lr", "eps"))
    # the schedule runs each group to its own ends
    scheduler = get_optimizer_param_scheduler(
        OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_iters=4, lr_decay_style="linear"),
        SimpleNamespace(param_groups=groups), global_batch_size=1, train_iters=4,
    )  # fmt: skip
    scheduler.step(increment=2)
    assert (groups[1]["lr"], mup["lr"]) == pytest.approx((5.5e-4, 1.375e-4))
    # a width multiplier of 1 (the base model) changes nothing
    assert not any(g.get("mup") for g in grouped(config, width=1.0))


def test_sgd_multiplies_the_vector_like_parameters_lr():
    config = OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=1e-3, weight_decay=0.1)
    groups = grouped(config, width=2.0)
    assert [(g["wd_mult"], g.get("mup", False), g["params"]) for g in groups] == [
        (0.0, True, ["hidden.bias", "norm.weight"]),
        (1.0, False, ["hidden.weight", "gate.weight"]),
        (1.0, True, ["embedding.weight", "output.weight"]),
    ]
    assert (groups[0]["max_lr"], groups[0]["min_lr"]) == (2e-2, 2e-3)
    assert "eps" not in groups[0]


def test_muon_scales_only_the_matrices_adam_steps():
    config = OptimizerConfig(optimizer="muon", lr=1e-3, min_lr=1e-4)
    groups = grouped(config, width=2.0)
    mup = [g for g in groups if g.get("mup")]
    assert [g["params"] for g in mup] == [["gate.weight"]]
    assert mup[0]["max_lr"] == 5e-4 and "eps" not in mup[0]  # Megatron: eps for Adam only
    assert any("hidden.weight" in g["params"] and not g.get("mup") for g in groups)


def test_a_decoupled_lr_keeps_its_groups():
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, weight_decay=0.1)
    groups = grouped(config, width=2.0)
    kinds = [(g.get("decoupled_lr", False), g.get("mup", False), g["params"]) for g in groups]
    assert kinds == [(False, False, ["hidden.bias", "norm.weight"]),
                     (False, True, ["hidden.weight", "gate.weight"]),
                     (True, False, ["embedding.weight", "output.weight"])]  # fmt: skip
    assert groups[2]["max_lr"] == 5e-3 and groups[1]["max_lr"] == 5e-4


def test_a_checkpoint_of_other_mup_groups_is_refused():
    """A checkpoint's muP group settles its schedule ends as a decoupled one does: a run
    at another width multiplier (another lr / m) must say which to keep."""
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1)
    group = grouped(config, width=2.0)[2]
    saved = dict(grouped(config, width=4.0)[2])
    with pytest.raises(ValueError, match=r"muP group has max_lr=0.00025, this run 0.0005"):
        _checked_hyper(group, saved, config)
    plain = grouped(config, width=1.0)[1]
    with pytest.raises(ValueError, match="another --decoupled-lr or muP"):
        _checked_hyper(plain, saved, config)
    kept = OptimizerConfig(lr=1e-3, min_lr=1e-4, use_checkpoint_opt_param_scheduler=True)
    assert _checked_hyper(group, saved, kept)["max_lr"] == 2.5e-4
