"""mp-state: the parallel layout of a run and everything that follows from it.

ParallelConfig (Megatron's field names) -> plan_groups / RankGenerator (pure
Python, any world size) -> initialize() (process groups over
torch.distributed, held in one ParallelState) -> seeds and RNG streams.
`mp_state.testing` runs code on N real ranks over gloo for tests.
"""

from mp_state import testing
from mp_state.config import ParallelConfig
from mp_state.determinism import apply_deterministic_mode
from mp_state.devices import (
    DEVICE_ENV,
    DeviceInfo,
    device_type,
    init_distributed,
    local_rank,
    select_device,
)
from mp_state.parallel_state import ParallelState, RankGroup, current, destroy, initialize
from mp_state.plan import (
    GroupPlan,
    default_embedding_ranks,
    default_position_embedding_ranks,
    plan_groups,
)
from mp_state.rank_generator import RankGenerator
from mp_state.rng import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    TENSOR_PARALLEL_RNG,
    RNGStatesTracker,
    get_rng_state,
    model_parallel_seeds,
    rng_state_kept,
    set_random_seeds,
    set_rng_state,
    stage_seed,
)

__all__ = [
    "DATA_PARALLEL_RNG",
    "DEVICE_ENV",
    "EXPERT_PARALLEL_RNG",
    "TENSOR_PARALLEL_RNG",
    "DeviceInfo",
    "GroupPlan",
    "ParallelConfig",
    "ParallelState",
    "RNGStatesTracker",
    "RankGenerator",
    "RankGroup",
    "apply_deterministic_mode",
    "current",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "destroy",
    "device_type",
    "get_rng_state",
    "init_distributed",
    "initialize",
    "local_rank",
    "model_parallel_seeds",
    "plan_groups",
    "rng_state_kept",
    "select_device",
    "set_random_seeds",
    "set_rng_state",
    "stage_seed",
    "testing",
]
