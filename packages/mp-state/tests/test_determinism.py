"""--deterministic-mode's process set-up (mp_state.apply_deterministic_mode): Megatron's
environment values filled in where unset, a launcher's own accepted values kept, values
that break repeatability refused naming the variable, torch's deterministic algorithms on."""

import pytest
import torch

from mp_state import apply_deterministic_mode


@pytest.fixture
def restored():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_the_environment_is_completed_and_torch_made_deterministic(restored):
    env = {"NCCL_ALGO": "Ring,CollnetDirect"}
    torch.use_deterministic_algorithms(False)
    apply_deterministic_mode(env)
    assert env == {"NCCL_ALGO": "Ring,CollnetDirect", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                   "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}  # fmt: skip
    assert torch.are_deterministic_algorithms_enabled()


REFUSED = [("NCCL_ALGO", "Tree"), ("NCCL_ALGO", ""), ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
           ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_values_that_break_repeatability_are_refused(restored, name, value):
    torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match=rf"--deterministic-mode with {name}={value!r}"):
        apply_deterministic_mode({name: value})
    assert not torch.are_deterministic_algorithms_enabled()
