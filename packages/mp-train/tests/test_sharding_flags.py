"""Megatron's sharded data-parallel flags map to mp's engines (--use-megatron-fsdp's four
strategies, --use-torch-fsdp2), and what FSDP does not compose with yet is refused at
validation in one line naming the flag. Training under them: tests/test_train_fsdp.py."""

from __future__ import annotations

import pytest

from mp_train import parse_config, validate

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
]  # fmt: skip
FSDP = ["--use-megatron-fsdp"]


def _optimizer(*flags: str):
    config = parse_config([*BASE, *flags])
    validate(config, 4)
    return config.optimizer


@pytest.mark.parametrize(
    ("flags", "fully_sharded", "reshard", "distributed"),
    [
        ([], False, False, False),
        ([*FSDP], True, True, False),  # Megatron's default strategy: optim_grads_params
        ([*FSDP, "--data-parallel-sharding-strategy", "optim_grads"], True, False, False),
        ([*FSDP, "--data-parallel-sharding-strategy", "optim"], False, False, True),
        # Megatron-FSDP implies the distributed optimizer; no_shard still shards nothing.
        ([*FSDP, "--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
         False, False, False),
        ([*FSDP, "--use-distributed-optimizer", "--overlap-grad-reduce",
          "--overlap-param-gather"], True, True, False),
        (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], True, True, False),
        (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
          "--torch-fsdp2-no-reshard-after-forward"], True, False, False),
    ],
)  # fmt: skip
def test_strategies_map_to_engines(flags, fully_sharded, reshard, distributed):
    optimizer = _optimizer(*flags)
    assert optimizer.fully_sharded is fully_sharded
    assert optimizer.reshard_after_forward is reshard
    assert optimizer.use_distributed_optimizer is distributed


def test_fsdp_dtensor_names_mps_format_under_megatron_fsdp():
    config = parse_config([*BASE, *FSDP, "--ckpt-format", "fsdp_dtensor", "--save", "/ckpt"])
    validate(config, 4)
    assert config.checkpoint.save == "/ckpt"


def test_gradients_reduce_in_fp32_unless_asked():
    assert _optimizer(*FSDP, "--bf16").grad_reduce_in_fp32
    assert not _optimizer(*FSDP, "--bf16", "--grad-reduce-in-bf16").grad_reduce_in_fp32
    assert not _optimizer("--bf16", "--grad-reduce-in-bf16").grad_reduce_in_fp32  # DDP too


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs "
         "--use-megatron-fsdp, as in Megatron-LM"),
        (["--init-model-with-meta-device", "--use-distributed-optimizer"],
         "--init-model-with-meta-device needs ZeRO-2/3"),
        ([*FSDP, "--init-model-with-meta-device", "--data-parallel-random-init"],
         "--init-model-with-meta-device with --data-parallel-random-init: the broadcast"),
        (["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"],
         "--use-torch-fsdp2 with --pipeline-model-parallel-size 2: not supported, as in "
         "Megatron-LM; --use-megatron-fsdp composes with it"),
        (["--use-torch-fsdp2"], "--use-torch-fsdp2 with tied input and output embeddings"),
        (["--use-torch-fsdp2", "--use-distributed-optimizer"],
         "use_torch_fsdp2=True with use_distributed_optimizer=True: FSDP2 shards"),
        (["--use-torch-fsdp2", "--fp16"], "use_torch_fsdp2=True with fp16=True: not supported"),
        ([*FSDP, "--use-torch-fsdp2"], "use_megatron_fsdp=True and use_torch_fsdp2=True are "
         "exclusive"),
        ([*FSDP, "--grad-reduce-in-bf16"], "grad_reduce_in_bf16=True needs bf16=True"),
        (["--overlap-param-gather"], "overlap_param_gather=True needs "
         "use_distributed_optimizer=True or use_megatron_fsdp=True"),
    ],
)  # fmt: skip
def test_what_fsdp_cannot_run_is_refused(flags, message):
    with pytest.raises(ValueError) as error:
        _optimizer(*flags)
    assert str(error.value).startswith(message)
