"""import-megatron --with-optimizer: each Megatron-LM fixture's Adam moments, fp32 main
parameters, step count, scheduler and training position, in mp's optimizer-state keys,
against the full tensors megatron-core recorded (reference.pt's "adam"); the hybrid
fixtures (Mamba, attention, MLP and MoE layers, the distributed optimizer at TP2 x DP2 in
both formats, and without it) and the DeepSeek-shaped ones with their multi-token
prediction module (multi-latent attention, DeepSeek's MoE; with and without the
distributed optimizer) and the Qwen3-Next-shaped ones (a gated DeltaNet layer, gated
attention; with and without it) too."""

import re
import shutil
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_ckpt.cli import main
from mp_ckpt.megatron.optimizer import megatron_param_order
from mp_ckpt.megatron.read import read_megatron

ASSETS = Path(__file__).parent / "assets" / "megatron"
DISTOPT = ["llama_torch_dist_tp2_distopt", "llama_torch_dist_pp2_dp2_distopt",
           "llama_torch_pp2_dp2_distopt", "llama_torch_dist_tp2_dp2_distopt",
           "hybrid_torch_dist_tp2_dp2_distopt", "hybrid_torch_tp2_dp2_distopt",
           "mla_mtp_torch_dist_tp2_dp2_distopt", "mla_mtp_torch_dist_tp1_distopt",
           "qwen3_next_torch_dist_tp2_dp2_distopt"]  # fmt: skip
CASES = ["llama_torch_dist_tp1", "llama_torch_tp2", "llama_torch_pp2", "gpt2_torch_dist_tp1",
         "moe_torch_dist_ep2", "moe_torch_ep2", "hybrid_optim_torch_dist_tp2",
         "hybrid_optim_torch_tp2", "mla_mtp_optim_torch_tp2", "qwen3_next_optim_torch_tp2",
         *DISTOPT]  # fmt: skip


def _fused(reader: CheckpointReader, state: str, name: str, swiglu: bool) -> torch.Tensor:
    """mp's pieces of a Megatron parameter, fused back into Megatron's layout. state None:
    the weights (the fp32 main parameters of an fp32 run)."""
    prefix = "" if state is None else f"optimizer.{state}."
    name = name.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
    name = name.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    name = name.replace("decoder.final_norm.", "decoder.final_layernorm.")  # a hybrid's
    name = name.replace(".mtp_model_layer.", ".transformer_layer.")  # an MTP module's layer
    gdn = re.match(r"(.+\.self_attention\.)(in_proj|conv1d)\.weight$", name)
    if gdn:  # a gated DeltaNet's fused tensor from mp's parts by key head
        parts = "query key value z beta alpha" if gdn.group(2) == "in_proj" else "query key value"
        pieces = [reader.read(f"{prefix}{gdn.group(1)}{gdn.group(2)}.{p}.weight")
                  for p in parts.split()]  # fmt: skip
        whole = torch.cat([p.reshape(-1, *p.shape[2:]) for p in pieces])
        return whole.unsqueeze(1) if gdn.group(2) == "conv1d" else whole
    mamba = re.match(r"(.+\.mixer\.)(in_proj\.weight|conv1d_weight)$", name)
    if mamba:  # a Mamba mixer's fused tensor from mp's grouped parts
        module, parts = ("in_proj", "z x B C dt") if "in_proj" in name else ("conv1d", "x B C")
        pieces = [
            reader.read(f"{prefix}{mamba.group(1)}{module}.{p}.weight") for p in parts.split()
        ]
        whole = torch.cat([p.reshape(-1, *p.shape[2:]) for p in pieces])
        return whole.unsqueeze(1) if module == "conv1d" else whole
    expert = re.match(r"(.+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$", name)
    if expert:  # mp stacks the experts: [experts, ...]
        whole = _fused(reader, state, expert.group(1) + expert.group(3), swiglu)
        return whole[int(expert.group(2))]
    if ".linear_qkv." in name:
        base, part = name.rsplit(".", 1)
        q, k, v = (reader.read(f"{prefix}{base}.{x}.{part}") for x in "qkv")
        gated = f"{prefix}{base}.gate.{part}" in reader.keys  # attention's output gate
        heads = [q, reader.read(f"{prefix}{base}.gate.{part}")] if gated else [q]
        fused = torch.cat([*heads, k.unsqueeze(1), v.unsqueeze(1)], dim=1)
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


@pytest.mark.parametrize("case", ["llama_torch_tp2", "llama_torch_pp2", "moe_torch_ep2",
                                  "hybrid_optim_torch_tp2", "mla_mtp_optim_torch_tp2",
                                  "qwen3_next_optim_torch_tp2"])  # fmt: skip
def test_legacy_state_order_is_megatrons_parameter_order(case):
    """The rule (decayed parameters, then the others, each in module order; with experts
    under expert parallelism the dense optimizer's, then the expert optimizer's: EP2 chains
    two, EP1 one) gives the order megatron-core recorded for every rank's optimizer state
    indices; the hybrid's Mamba layers, multi-latent attention and a multi-token prediction
    module in their module order too."""
    reference = safe_load(ASSETS / case / "reference.pt")
    directory = ASSETS / case / "iter_0000002"
    for rank, layout in enumerate(reference["optimizer_layout_per_rank"]):
        files = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
        saved = safe_load(files[rank])
        model = saved["model"]
        weights = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)
                   and "_extra_state" not in k and not k.endswith("expert_bias")}  # fmt: skip

        def decayed_first(names, weights=weights):
            decayed = [n for n in names if weights[n].dim() > 1 and not n.endswith("bias")]
            return decayed + [n for n in names if n not in decayed]

        order = megatron_param_order(weights)
        chained = isinstance(saved["optimizer"], list)  # the dense, then the expert one
        experts = [n for n in order if ".local_experts." in n] if chained else []
        dense = [n for n in order if n not in experts]
        assert decayed_first(dense) + decayed_first(experts) == layout["param_order"]


def _module_name(name: str, stage: int, per_stage: int) -> str:
    """A stage's local module name (layers from 0) as a model-global one."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name
    return f"decoder.layers.{int(match.group(1)) + stage * per_stage}.{match.group(2)}"


@pytest.mark.parametrize("case", DISTOPT)
def test_distributed_optimizer_map_is_megatrons(case):
    """The rebuilt flat-buffer map (reverse module order, 64-aligned, buckets cut at the
    unpadded sizes) is the one megatron-core recorded for every rank, and the bucket sizes
    Megatron's rule gives for a legacy file (no sizes stored) are the recorded ones."""
    from mp_ckpt.megatron.distopt import _LOCAL_NORMS, buffer_params, megatron_buckets, place
    from mp_ckpt.megatron.read import read_megatron

    reference = safe_load(ASSETS / case / "reference.pt")
    args = reference["args"]
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    dp, per_stage = args["data_parallel_size"], args["num_layers"] // pp
    model = read_megatron(ASSETS / case)
    bucket_size = getattr(model.args, "ddp_bucket_size", None)
    for rank, layout in enumerate(reference["optimizer_layout_per_rank"]):
        # Megatron's default rank order: TP fastest, then DP, then PP
        stage, tp_rank = rank // (tp * dp), rank % tp
        (buffer,) = layout["grad_buffer"]
        recorded = {_module_name(n, stage, per_stage): v
                    for n, v in buffer["param_index_map"].items()}  # fmt: skip
        buckets = buffer["bucket_indices"]
        unpadded = [max(e for _, e, b in recorded.values() if b == i) - start
                    for i, (start, _) in enumerate(buckets)]  # fmt: skip
        params = buffer_params(model, stage, tp_rank, case)
        rebuilt = {}
        for (name, shape), (b, start) in zip(params, place([s for _, s in params], unpadded,
                                                            case), strict=True):  # fmt: skip
            for te, norm in _LOCAL_NORMS.items():
                name = name.replace(te, norm)
            name = re.sub(r"\.mixer\.conv1d\.(weight|bias)$", r".mixer.conv1d_\1", name)
            name = name.replace(".transformer_layer.", ".mtp_model_layer.")
            offset = buckets[b][0] + start
            rebuilt[name] = (offset, offset + shape.numel(), b)
        assert rebuilt == recorded
        expected = bucket_size if stage == 0 and model.args.overlap_grad_reduce else None
        assert megatron_buckets([s.numel() for _, s in params], expected) == unpadded
    if "dp2" in case:  # the first stage of these fixtures is cut into 4 or 5 buckets
        first = reference["optimizer_layout_per_rank"][0]["grad_buffer"][0]
        assert len(first["bucket_indices"]) >= 4


def test_multi_token_prediction_under_pipeline_parallelism_is_refused(tmp_path, monkeypatch):
    """The last stage's copy of the embedding beside the MTP modules: not read."""
    import mp_ckpt.megatron.importer as importer
    from mp_ckpt.megatron.distopt import buffer_params

    model = read_megatron(ASSETS / "mla_mtp_torch_dist_tp1_distopt")
    model.args.pipeline_model_parallel_size = 2
    with pytest.raises(ValueError, match="multi-token prediction under pipeline parallelism"):
        buffer_params(model, 0, 0, "here")
    monkeypatch.setattr(importer, "read_megatron", lambda src, iteration=None: model)
    with pytest.raises(ValueError, match=r"multi-token prediction modules under pipeline "
                                         r"parallelism \(PP 2"):  # fmt: skip
        import_megatron(ASSETS / "mla_mtp_torch_dist_tp1_distopt", tmp_path / "mp",
                        with_optimizer=True)  # fmt: skip


def test_a_bucket_of_another_size_is_refused(tmp_path):
    """A legacy distrib_optim.pt whose flat state lost elements, and a torch_dist bucket
    that disagrees with its recorded size, are refused naming the file and the key."""
    from mp_ckpt.megatron.distopt import read_distributed_buckets
    from mp_ckpt.megatron.optimizer import _load_dist
    from mp_ckpt.megatron.read import _SafeReader

    case = "llama_torch_pp2_dp2_distopt"
    copy = tmp_path / case
    shutil.copytree(ASSETS / case, copy)
    path = copy / "iter_0000002" / "mp_rank_00_001" / "distrib_optim.pt"
    saved = torch.load(path, weights_only=False)
    (buffer,) = saved[0].values()
    buffer["exp_avg_sq"] = buffer["exp_avg_sq"][:-64]
    torch.save(saved, path)
    with pytest.raises(ValueError, match=r"mp_rank_00_001/distrib_optim.pt: 0.exp_avg_sq: "
                                         r"expected 13472 elements"):  # fmt: skip
        import_megatron(copy, tmp_path / "out", with_optimizer=True)

    case = "llama_torch_dist_pp2_dp2_distopt"
    model = read_megatron(ASSETS / case)
    storage = _SafeReader(model.directory)
    entries = storage.read_metadata().state_dict_metadata
    keys = [k for k in entries if k.startswith("optimizer.distributed.")]
    tensors, raw = _load_dist(storage, keys, entries)
    sizes_key = "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"
    (sizes,) = raw[sizes_key][0][0].values()
    sizes[2] -= 64
    with pytest.raises(ValueError, match=r"dp_group_idx_0.per_bucket_numel_unpadded: bucket 2 "
                                         r"holds 2048 elements"):  # fmt: skip
        read_distributed_buckets(model, tensors, raw)
    sizes[2] += 64
    bucket = next(
        k
        for k in tensors
        if k.endswith(
            "dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_3.param"
        )
    )
    tensors[bucket] = tensors[bucket][:-1]
    with pytest.raises(
        ValueError,
        match=r"dp_group_idx_0.gbuf_idx_0.bucket_idx_3.param: "
        r"5183 elements, per_bucket_numel_unpadded says 5184",
    ):
        read_distributed_buckets(model, tensors, raw)


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


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("untie_embeddings_and_output_weights", False, "tied embeddings under pipeline parallelism"),
    ("decoder_first_pipeline_num_layers", 1, "only an even pipeline split of 2 layers"),
    ("num_layers_per_virtual_pipeline_stage", 1, "without virtual stages"),
    ("account_for_embedding_in_pipeline_split", True, "only an even pipeline split"),
    ("account_for_loss_in_pipeline_split", True, "only an even pipeline split"),
])  # fmt: skip
def test_a_distributed_optimizer_layout_it_cannot_map_is_refused(setting, value, message):
    import argparse
    import dataclasses

    from mp_ckpt.megatron.optimizer import read_megatron_optimizer

    model = read_megatron(ASSETS / "llama_torch_dist_pp2_dp2_distopt")
    args = argparse.Namespace(**{**vars(model.args), setting: value})
    with pytest.raises(ValueError, match=r"dp_group_idx_0: .*" + message):
        read_megatron_optimizer(dataclasses.replace(model, args=args))


def test_megatron_groups_of_a_decoupled_lr_stay_apart():
    # No megatron-core fixture trains with --decoupled-lr: Megatron's param_groups as its
    # _get_param_groups writes them (every group carries max_lr, min_lr, is_decoupled_lr).
    from mp_ckpt.megatron.optimizer import _groups

    def group(wd_mult, decoupled, max_lr):
        return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": decoupled,
                "max_lr": max_lr, "min_lr": 0.0, "lr": max_lr, "params": []}  # fmt: skip

    dense = [group(1.0, False, 1e-3), group(0.0, False, 1e-3), group(1.0, True, 1e-2)]
    got = _groups([*dense, group(1.0, False, 1e-3)], "ckpt")  # the experts' optimizer too
    assert [(g["wd_mult"], g.get("decoupled_lr", False), g["max_lr"]) for g in got] == [
        (0.0, False, 1e-3), (1.0, False, 1e-3), (1.0, True, 1e-2)]  # fmt: skip
    # The legacy torch format matches groups to names by weight decay alone: refused.
    from mp_ckpt.megatron.optimizer import _torch_optimizer_state

    legacy = {"optimizer": {"state": {}, "param_groups": dense}}
    with pytest.raises(ValueError, match=r"rank\.pt: optimizer\.param_groups hold a decoupled"):
        _torch_optimizer_state(legacy, {}, Path("rank.pt"), {})
