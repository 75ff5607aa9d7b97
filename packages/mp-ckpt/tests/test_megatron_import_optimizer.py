"""import-megatron --with-optimizer: each Megatron-LM fixture's Adam moments, fp32 main
parameters, step count, scheduler and training position, in mp's optimizer-state keys,
against the full tensors megatron-core recorded (reference.pt's "adam")."""

import re
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_ckpt.cli import main
from mp_ckpt.megatron_optimizer import megatron_param_order

ASSETS = Path(__file__).parent / "assets" / "megatron"
CASES = ["llama_torch_dist_tp1", "llama_torch_dist_tp2_distopt", "llama_torch_tp2",
         "llama_torch_pp2", "gpt2_torch_dist_tp1", "moe_torch_dist_ep2",
         "moe_torch_ep2"]  # fmt: skip


def _fused(reader: CheckpointReader, state: str, name: str, swiglu: bool) -> torch.Tensor:
    """mp's pieces of a Megatron parameter, fused back into Megatron's layout. state None:
    the weights (the fp32 main parameters of an fp32 run)."""
    prefix = "" if state is None else f"optimizer.{state}."
    name = name.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
    name = name.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    expert = re.match(r"(.+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$", name)
    if expert:  # mp stacks the experts: [experts, ...]
        whole = _fused(reader, state, expert.group(1) + expert.group(3), swiglu)
        return whole[int(expert.group(2))]
    if ".linear_qkv." in name:
        base, part = name.rsplit(".", 1)
        q, k, v = (reader.read(f"{prefix}{base}.{x}.{part}") for x in "qkv")
        fused = torch.cat([q, k.unsqueeze(1), v.unsqueeze(1)], dim=1)
        return fused.reshape(-1, *q.shape[3:])
    if ".linear_fc1." in name and swiglu:
        base, part = name.rsplit(".", 1)
        dim = 1 if ".mlp.experts." in name else 0
        return torch.cat([reader.read(f"{prefix}{base}.{x}.{part}") for x in ("gate", "up")],
                         dim=dim)  # fmt: skip
    return reader.read(prefix + name)


@pytest.mark.parametrize("case", CASES)
def test_imported_adam_state_is_megatrons(case, tmp_path):
    reference = safe_load(ASSETS / case / "reference.pt")
    out = import_megatron(ASSETS / case, tmp_path / "mp", with_optimizer=True)
    assert out.name == "iter_0000002"
    reader = CheckpointReader(tmp_path / "mp")
    swiglu = bool(reference["args"]["swiglu"])
    assert reference["adam"]
    for name, recorded in reference["adam"].items():
        for state in ("exp_avg", "exp_avg_sq"):
            got = _fused(reader, state, name, swiglu)
            torch.testing.assert_close(got, recorded[state], rtol=0, atol=0, msg=name + state)
        # fp32 run: the main parameters are the weights, and no copy is written
        torch.testing.assert_close(_fused(reader, None, name, swiglu), recorded["param"],
                                   rtol=0, atol=0)  # fmt: skip
        assert recorded["step"] == reference["optimizer_step"]
    assert not any(k.startswith("optimizer.fp32_param.") for k in reader.keys)
    # every parameter has its moments; the router's expert bias is a buffer
    weights = [k for k in reader.keys
               if not k.startswith("optimizer.") and not k.endswith("expert_bias")]  # fmt: skip
    for state in ("exp_avg", "exp_avg_sq"):
        assert sorted(k.removeprefix(f"optimizer.{state}.") for k in reader.keys
                      if k.startswith(f"optimizer.{state}.")) == sorted(weights)  # fmt: skip
    common = torch.load(out / "common.pt", weights_only=False)
    assert common["iteration"] == reference["iteration"] == 2
    assert common["train_state"]["iteration"] == 2
    # 2 steps x the global batch
    assert (
        common["train_state"]["consumed_train_samples"]
        == 2 * reference["args"]["global_batch_size"]
    )
    assert common["optimizer"]["step"] == float(reference["optimizer_step"])
    assert common["scheduler"] == reference["scheduler"]
    groups = common["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [0.0, 1.0]  # mp's order: (wd_mult, lr_mult)
    assert [g["weight_decay"] for g in groups] == [0.0, 0.01]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in groups)
    assert groups[0]["lr"] == pytest.approx(reference["lr_next"])


@pytest.mark.parametrize("case", ["llama_torch_tp2", "llama_torch_pp2", "moe_torch_ep2"])
def test_legacy_state_order_is_megatrons_parameter_order(case):
    """The rule (decayed parameters, then the others, each in module order; with experts
    the dense optimizer's, then the expert optimizer's) gives the order megatron-core
    recorded for every rank's optimizer state indices."""
    reference = safe_load(ASSETS / case / "reference.pt")
    directory = ASSETS / case / "iter_0000002"
    for rank, layout in enumerate(reference["optimizer_layout_per_rank"]):
        files = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
        model = safe_load(files[rank])["model"]
        weights = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)
                   and "_extra_state" not in k and not k.endswith("expert_bias")}  # fmt: skip

        def decayed_first(names, weights=weights):
            decayed = [n for n in names if weights[n].dim() > 1 and not n.endswith("bias")]
            return decayed + [n for n in names if n not in decayed]

        order = megatron_param_order(weights)
        experts = [n for n in order if ".local_experts." in n]
        dense = [n for n in order if n not in experts]
        assert decayed_first(dense) + decayed_first(experts) == layout["param_order"]


def test_distributed_optimizer_map_is_megatrons():
    """The rebuilt flat-buffer map (reverse module order, 64-aligned) is the recorded one."""
    from mp_ckpt.megatron_optimizer import _ALIGN, _tp_piece
    from mp_ckpt.megatron_read import read_megatron

    case = "llama_torch_dist_tp2_distopt"
    reference = safe_load(ASSETS / case / "reference.pt")
    model = read_megatron(ASSETS / case)
    rename = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}  # fmt: skip
    tensors = {}
    for name, tensor in model.tensors.items():
        for old, new in rename.items():
            name = name.replace(old, new)
        tensors[name] = tensor
    for rank, layout in enumerate(reference["optimizer_layout_per_rank"]):
        recorded = layout["grad_buffer"][0]["param_index_map"]
        offset, rebuilt = 0, {}
        for name in reversed(megatron_param_order(tensors)):
            offset = -(-offset // _ALIGN) * _ALIGN
            numel = _tp_piece(name, tensors[name], rank, 2, True).numel()
            rebuilt[name] = (offset, offset + numel, 0)
            offset += numel
        assert rebuilt == recorded


def test_cli_with_optimizer_and_what_it_refuses(tmp_path, capsys):
    import argparse

    args = argparse.Namespace(**safe_load(ASSETS / "llama_torch_tp2" / "reference.pt")["args"])
    src = ASSETS / "llama_torch_tp2"
    assert main(["import-megatron", str(src), str(tmp_path / "o"), "--with-optimizer"]) == 0
    assert (tmp_path / "o" / "iter_0000002" / "common.pt").exists()
    # a checkpoint saved without optimizer state
    staged = tmp_path / "noopt" / "iter_0000002"
    for t in range(2):
        state = safe_load(src / "iter_0000002" / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
        folder = staged / f"mp_rank_{t:02d}"
        folder.mkdir(parents=True)
        torch.save(
            {"args": args, "iteration": 2, "model": state["model"]}, folder / "model_optim_rng.pt"
        )
    assert main(["import-megatron", str(staged), str(tmp_path / "o2"), "--with-optimizer"]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_00/model_optim_rng.pt: optimizer: no torch optimizer state" in err
