"""OptimizerConfig validation (one test per rule) and parameter groups."""

import math
from types import SimpleNamespace

import pytest
import torch

from mp_optim import OptimizerConfig, get_param_groups
from mp_optim.scheduler import get_optimizer_param_scheduler

RULES = [
    (dict(optimizer="lamb"), "optimizer='lamb' must be one of adam, sgd"),
    (dict(lr_decay_style="step"), "lr_decay_style='step' must be one of"),
    (dict(lr_wsd_decay_style="step"), "lr_wsd_decay_style='step' must be one of"),
    (dict(weight_decay_incr_style="step"), "weight_decay_incr_style='step' must be one of"),
    (dict(fp16=True, bf16=True), "fp16=True and bf16=True are exclusive"),
    (dict(lr=-1.0), "lr=-1.0 must be >= 0"),
    (dict(min_lr=-1.0), "min_lr=-1.0 must be >= 0"),
    (dict(lr=1e-4, min_lr=1e-3), "min_lr=0.001 must be <= lr=0.0001"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be >= 0"),
    (dict(clip_grad=-1.0), "clip_grad=-1.0 must be >= 0"),
    (dict(adam_eps=-1.0), "adam_eps=-1.0 must be >= 0"),
    (dict(sgd_momentum=-0.5), "sgd_momentum=-0.5 must be >= 0"),
    (dict(adam_beta1=1.0), r"adam_beta1=1.0 must be in \[0, 1\)"),
    (dict(adam_beta2=-0.1), r"adam_beta2=-0.1 must be in \[0, 1\)"),
    (dict(loss_scale=0.0), "loss_scale=0.0 must be > 0"),
    (dict(initial_loss_scale=0.0), "initial_loss_scale=0.0 and min_loss_scale=1.0 must be > 0"),
    (dict(loss_scale_window=0), "loss_scale_window=0 must be >= 1"),
    (dict(hysteresis=0), "hysteresis=0 must be >= 1"),
    (dict(bucket_size=0), "bucket_size=0 must be >= 1"),
    (dict(num_buckets=0), "num_buckets=0 must be >= 1"),
    (dict(num_buckets=4, bucket_size=100), "num_buckets=4 with bucket_size=100: give one"),
    (
        dict(
            check_for_large_grads=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads",
        ),
        "check_for_large_grads checks DDP's gradient buckets, which FSDP",
    ),
    (dict(overlap_param_gather=True), "overlap_param_gather=True needs use_distributed_optimizer"),
    (dict(lr_warmup_fraction=1.5), r"lr_warmup_fraction=1.5 must be in \[0, 1\]"),
    (
        dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
        "are exclusive",
    ),
    (dict(start_weight_decay=-0.1, weight_decay_incr_style="linear"), "must be >= 0"),
    (
        dict(start_weight_decay=0.0, weight_decay_incr_style="cosine"),
        "weight_decay_incr_style='cosine' needs start_weight_decay and end_weight_decay",
    ),
    (
        dict(start_weight_decay=0.0, end_weight_decay=0.1),
        "weight_decay_incr_style='constant' needs start_weight_decay == end_weight_decay",
    ),
    (dict(decoupled_min_lr=1e-5), "decoupled_min_lr=1e-05 needs decoupled_lr"),
    (dict(decoupled_lr=-1.0), "decoupled_lr=-1.0 must be >= 0"),
    (dict(decoupled_lr=1e-4, decoupled_min_lr=-1.0), "decoupled_min_lr=-1.0 must be >= 0"),
    (
        dict(decoupled_lr=1e-4, decoupled_min_lr=1e-3),
        r"decoupled_min_lr=0.001 \(the end of the decoupled schedule\) must be <= decoupled_lr",
    ),
    (dict(lr=1e-3, min_lr=1e-3, decoupled_lr=1e-4), r"min_lr=0.001 \(the end of the decoupled"),
    (dict(decoupled_lr=1e-4, lr_warmup_init=1e-3), "lr_warmup_init=0.001 must be <= decoupled_lr"),
]


@pytest.mark.parametrize("fields,message", RULES, ids=[m[:40] for _, m in RULES])
def test_invalid_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**fields)


def test_derived_settings():
    config = OptimizerConfig(lr=1e-3, bf16=True, weight_decay=0.1)
    assert config.grad_reduce_in_fp32 and config.model_dtype == torch.bfloat16
    assert config.start_wd == config.end_wd == 0.1
    assert OptimizerConfig(fp16=True).model_dtype == torch.float16
    assert not OptimizerConfig().grad_reduce_in_fp32


def test_param_groups_exclude_biases_and_norms_from_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    groups = get_param_groups(
        [model], config, scale_lr_cond=lambda name, p: name.startswith("2."), lr_mult=0.5
    )
    by_key = {(g["wd_mult"], g["lr_mult"]): g for g in groups}
    assert set(by_key) == {(0.0, 0.5), (0.0, 1.0), (1.0, 0.5), (1.0, 1.0)}
    named = dict(model.named_parameters())
    assert by_key[(1.0, 1.0)]["params"] == [named["0.weight"]]
    assert by_key[(1.0, 0.5)]["params"] == [named["2.weight"]]
    assert by_key[(0.0, 0.5)]["params"] == [named["2.bias"]]
    assert by_key[(0.0, 1.0)]["params"] == [named["0.bias"], named["1.weight"], named["1.bias"]]
    assert by_key[(1.0, 0.5)]["lr"] == 5e-4 and by_key[(0.0, 1.0)]["weight_decay"] == 0.0
    custom = get_param_groups([model], config, no_weight_decay_cond=lambda n, p: False)
    assert [g["wd_mult"] for g in custom] == [1.0]


def test_apply_wd_to_qk_layernorm_decays_the_query_and_key_norms_alone():
    """Megatron's rule with apply_wd_to_qk_layernorm (Qwen3-Next's): the 1-D weights of
    q_layernorm and k_layernorm are decayed, every other norm and bias is not."""
    attention = torch.nn.Module()
    attention.q_layernorm, attention.k_layernorm = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)
    attention.linear_proj = torch.nn.Linear(4, 4)
    model = torch.nn.Module()
    model.self_attention, model.input_layernorm = attention, torch.nn.RMSNorm(4)
    named = dict(model.named_parameters())
    for apply, decayed in ((False, ["self_attention.linear_proj.weight"]),
                           (True, ["self_attention.q_layernorm.weight",
                                   "self_attention.k_layernorm.weight",
                                   "self_attention.linear_proj.weight"])):  # fmt: skip
        config = OptimizerConfig(lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm=apply)
        groups = {g["wd_mult"]: g["params"] for g in get_param_groups([model], config)}
        assert [id(p) for p in groups[1.0]] == [id(named[n]) for n in decayed]
        assert id(named["input_layernorm.weight"]) in {id(p) for p in groups[0.0]}


def test_a_decoupled_lr_gives_the_marked_weights_groups_of_their_own_and_their_schedule():
    # Megatron's decoupled learning rate: the weights a model marks (its word embedding and
    # output layer) get their own groups, max_lr = decoupled_lr, min_lr = decoupled_min_lr
    # (or min_lr), and the same warm-up and decay as lr.
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4),
                                torch.nn.Linear(4, 8))  # fmt: skip
    model[0].weight.is_embedding_or_output_parameter = True
    model[2].weight.is_embedding_or_output_parameter = True
    named = dict(model.named_parameters())
    plain = OptimizerConfig(lr=1e-3, min_lr=1e-4)
    assert [len(g["params"]) for g in get_param_groups([model], plain)] == [2, 3]
    for low, expected_low in ((None, 1e-4), (2e-5, 2e-5)):
        config = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=low,
                                 lr_warmup_iters=2, lr_decay_iters=6,
                                 lr_decay_style="cosine")  # fmt: skip
        groups = get_param_groups([model], config)
        assert [(g["wd_mult"], g.get("decoupled_lr", False)) for g in groups] == [
            (0.0, False), (1.0, False), (1.0, True)]  # fmt: skip
        decoupled = groups[2]
        assert decoupled["params"] == [named["0.weight"], named["2.weight"]]
        assert (decoupled["max_lr"], decoupled["min_lr"]) == (5e-3, expected_low)
        assert groups[1]["params"] == [named["1.weight"]] and "max_lr" not in groups[1]
        scheduler = get_optimizer_param_scheduler(
            config, SimpleNamespace(param_groups=groups), global_batch_size=1, train_iters=6
        )
        seen = []
        for _ in range(7):
            seen.append((groups[1]["lr"], decoupled["lr"]))
            scheduler.step(increment=1)
        assert seen[1] == pytest.approx((0.5e-3, 2.5e-3))  # half-way through warm-up
        assert seen[2] == pytest.approx((1e-3, 5e-3))  # the peaks
        cosine = 0.5 * (1 + math.cos(math.pi * 1 / 4))  # 1 of 4 decay steps
        assert seen[3] == pytest.approx(
            (1e-4 + cosine * 9e-4, expected_low + cosine * (5e-3 - expected_low))
        )
        assert seen[6] == pytest.approx((1e-4, expected_low))  # the ends
