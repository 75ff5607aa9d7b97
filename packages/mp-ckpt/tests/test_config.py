"""CheckpointConfig's checks: non-persistent checkpoints and override_ckpt_iteration."""

import os

import pytest

from mp_ckpt import CheckpointConfig


def test_where_non_persistent_checkpoints_live():
    assert CheckpointConfig(save="s").non_persistent_dir("s") is None  # none asked for
    kind = {"non_persistent_ckpt_type": "global"}
    assert CheckpointConfig(**kind).non_persistent_dir("s") == os.path.join("s", "non_persistent")
    assert CheckpointConfig(**kind).non_persistent_dir(None) is None
    named = CheckpointConfig(**kind, non_persistent_global_ckpt_dir="fast")
    assert named.non_persistent_dir("s") == named.non_persistent_dir(None) == "fast"
    frequent = CheckpointConfig(**kind, save="s", non_persistent_save_interval=5)
    assert frequent.non_persistent_save_interval == 5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"non_persistent_save_interval": 2, "save": "s"},
         "non_persistent_save_interval=2 needs non_persistent_ckpt_type global"),
        ({"non_persistent_save_interval": 2, "non_persistent_ckpt_type": "global"},
         "saves only beside save: set save"),
        ({"non_persistent_save_interval": 0, "non_persistent_ckpt_type": "global", "save": "s"},
         "non_persistent_save_interval=0 must be >= 1"),
        ({"non_persistent_ckpt_type": "local"},
         "non_persistent_ckpt_type='local': per-rank local checkpoints need NVIDIA Resiliency"),
        ({"non_persistent_ckpt_type": "in_memory"}, "'in_memory': per-rank local checkpoints"),
        ({"save": "run/", "non_persistent_global_ckpt_dir": "run"},
         "non_persistent_global_ckpt_dir=run is save: its checkpoints would replace save's"),
        ({"load": "run", "non_persistent_global_ckpt_dir": "./run"}, "is load"),
        ({"override_ckpt_iteration": -1}, "override_ckpt_iteration=-1 must be >= 0"),
        ({"override_ckpt_iteration": 3, "finetune": True}, "finetune starts at 0: give one"),
    ],
)  # fmt: skip
def test_refused_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**settings)
