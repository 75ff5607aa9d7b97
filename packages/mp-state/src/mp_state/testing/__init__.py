"""Test helpers of mp: real multi-rank runs over gloo, and fake worlds of any size."""

from mp_state.testing.fake_world import fake_world
from mp_state.testing.jobs import TorchrunJob
from mp_state.testing.launcher import (
    RankFailure,
    RankTimeout,
    default_start_method,
    run_on_ranks,
)

__all__ = [
    "RankFailure",
    "RankTimeout",
    "TorchrunJob",
    "default_start_method",
    "fake_world",
    "run_on_ranks",
]
