"""eager_when_compiled: outside a compiled region the function runs as it is; inside one
each wrapper runs its own function eagerly (a graph break), also when several wrapped
functions share one code object (closures of one factory), which a table keyed by the
function mixed up: every wrapper of the region ran the first one's."""

import pytest
import torch
import torch._dynamo

from mp_layers.transformer.eager import arm_eager_functions, eager_when_compiled


def scaled_by(factor: int):
    def scale(x):
        return x * factor

    return eager_when_compiled(scale)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("armed", [True, False], ids=["armed", "disabled at trace time"])
def test_each_wrapper_runs_its_own_function(fresh_dynamo, armed):
    scales = [scaled_by(factor) for factor in (2, 3, 5)]
    if armed:
        arm_eager_functions()

    def body(x):
        for scale in scales:
            x = torch.sin(scale(x))
        return x

    x = torch.linspace(-1, 1, 8)
    want = body(x)
    got = torch.compile(body, backend="eager")(x)
    torch.testing.assert_close(got, want)
    assert len(torch._dynamo.utils.counters["graph_break"]) > 0  # the functions stayed eager
