"""import-megatron --with-optimizer of a run trained with Megatron-LM's Muon
(`llama_muon_torch_dist_tp2`, written by megatron-core with emerging-optimizers): each
matrix's momentum buffer in mp's `optimizer.momentum_buffer.<logical key>` entries (the
fused QKV and SwiGLU fc1 unfused, the TP pieces joined), Adam's moments for the
embedding, the output layer and the norms, and the parameter groups as mp's Muon holds
them; the layouts whose Muon state is not read are refused."""

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_ckpt.megatron.optimizer import read_megatron_optimizer
from mp_ckpt.megatron.read import read_megatron

CASE = Path(__file__).parent / "assets" / "megatron" / "llama_muon_torch_dist_tp2"


def _logical(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Megatron TP1 tensor of the Llama fixture as mp's logical tensors (qkv: rows per
    query group [q q k v] x head dim 8; SwiGLU fc1: [gate; up])."""
    base, part = name.rsplit(".", 1)
    if base.endswith("linear_qkv"):
        groups = tensor.view(2, 4, 8, -1)
        return {f"{base}.q.{part}": groups[:, :2], f"{base}.k.{part}": groups[:, 2],
                f"{base}.v.{part}": groups[:, 3]}  # fmt: skip
    if base.endswith("linear_fc1"):
        gate, up = tensor.chunk(2)
        return {f"{base}.gate.{part}": gate, f"{base}.up.{part}": up}
    return {name: tensor}


def _keys(reader: CheckpointReader, state: str) -> set[str]:
    prefix = f"optimizer.{state}."
    return {k.removeprefix(prefix) for k in reader.keys if k.startswith(prefix)}


def test_imported_muon_state_is_megatrons(tmp_path):
    reference = safe_load(CASE / "reference.pt")
    out = import_megatron(CASE, tmp_path / "mp", with_optimizer=True)
    reader = CheckpointReader(tmp_path / "mp")
    assert reference["muon"] and reference["adam"]
    compared = 0
    for name, recorded in reference["muon"].items():  # qkv, proj, fc1, fc2 of both layers
        for key, expected in _logical(name, recorded["momentum_buffer"]).items():
            got = reader.read(f"optimizer.momentum_buffer.{key}")
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=key)
            torch.testing.assert_close(reader.read(key), _logical(name, recorded["param"])[key],
                                       rtol=0, atol=0, msg=key)  # fmt: skip
            assert expected.abs().max() > 0  # two steps moved it
            compared += 1
    assert compared == 3 + 1 + 2 + 1 + 3  # layer 0's q k v, proj, gate up; layer 1's fc2, q k v
    for name, recorded in reference["adam"].items():  # embedding, a norm, output layer
        for state in ("exp_avg", "exp_avg_sq"):
            got = reader.read(f"optimizer.{state}.{name}")
            torch.testing.assert_close(got, recorded[state], rtol=0, atol=0, msg=name + state)
    # Muon's matrices have a momentum buffer and no moments; every other parameter Adam's
    weights = {k for k in reader.keys if not k.startswith("optimizer.")}
    muon, adam = _keys(reader, "momentum_buffer"), _keys(reader, "exp_avg")
    assert muon == {k for k in weights if ".linear_" in k}
    assert adam == _keys(reader, "exp_avg_sq") == weights - muon
    assert not any(k.startswith("optimizer.fp32_param.") for k in reader.keys)

    common = torch.load(out / "common.pt", weights_only=False)
    assert common["iteration"] == common["train_state"]["iteration"] == 2
    assert common["train_state"]["consumed_train_samples"] == 4
    assert common["optimizer"]["step"] == float(reference["optimizer_step"]) == 2.0
    assert common["scheduler"] == reference["scheduler"]
    # mp's Muon: its groups (one per kind; no matrix is undecayed), then Adam's
    groups = common["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [0.0, 1.0, 0.0, 1.0]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.01, 0.0, 0.01]
    assert [g.get("momentum") for g in groups] == [0.9, 0.9, None, None]
    assert [g.get("betas") for g in groups] == [None, None, (0.9, 0.95), (0.9, 0.95)]
    assert all(g["lr"] == pytest.approx(reference["lr_next"]) for g in groups)


@pytest.mark.parametrize(("change", "message"), [
    ({"use_distributed_optimizer": True}, "Muon's state in the layer-wise distributed optimizer"),
    ({"format": "torch"}, "Muon's state in legacy torch files"),
    ({"optimizer": "sgd"}, "args optimizer='sgd': --with-optimizer reads Adam's and Muon's"),
])  # fmt: skip
def test_a_muon_layout_it_does_not_read_is_refused(change, message):
    model = read_megatron(CASE)
    args = {k: v for k, v in change.items() if k != "format"}
    model = dataclasses.replace(model, args=argparse.Namespace(**{**vars(model.args), **args}),
                                format=change.get("format", model.format))  # fmt: skip
    with pytest.raises(ValueError, match=r"llama_muon_torch_dist_tp2.*: " + message):
        read_megatron_optimizer(model)
