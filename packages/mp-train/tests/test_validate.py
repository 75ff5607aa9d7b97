"""`mp_train.validate` refuses layouts the model cannot run yet, with a one-line reason."""

from __future__ import annotations

import pytest

from mp_train import parse_config, validate

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
]  # fmt: skip


def _validate(*flags: str, world: int = 4) -> dict[str, int]:
    return validate(parse_config([*BASE, *flags]), world)


def test_the_dense_layouts_validate():
    assert _validate("--tensor-model-parallel-size", "2")["data_parallel_size"] == 2
    assert _validate("--pipeline-model-parallel-size", "2")["data_parallel_size"] == 2
    # An expert tensor-parallel size equal to the dense one is the default spelled out.
    flags = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    assert _validate(*flags)["data_parallel_size"] == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context-parallel-size", "2"], r"^context_parallel_size=2: context parallelism is "),
        (
            ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            r"^context_parallel_size=2: ",
        ),
        (["--expert-model-parallel-size", "2"], r"^expert_model_parallel_size=2: .* no mixture"),
        (
            ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
            r"^expert_tensor_parallel_size=1: .* follows tensor_model_parallel_size=2",
        ),
    ],
)
def test_context_and_expert_parallelism_are_refused(flags, message):
    with pytest.raises(ValueError, match=message) as error:
        _validate(*flags)
    assert "\n" not in str(error.value)
