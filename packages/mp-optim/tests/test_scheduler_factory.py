"""get_optimizer_param_scheduler: the scheduler built from an OptimizerConfig, its
iteration-based settings turned into samples (x the global batch size)."""

from types import SimpleNamespace

import pytest

from mp_optim.config import OptimizerConfig
from mp_optim.scheduler import get_optimizer_param_scheduler


def _optimizer():
    """All the scheduler touches of an optimizer: its parameter groups."""
    return SimpleNamespace(param_groups=[{}])


def test_iteration_based_with_warmup_fraction():
    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_fraction=0.1)
    scheduler = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=4, train_iters=100
    )
    assert scheduler.lr_decay_steps == 400  # 100 iterations * 4
    assert scheduler.lr_warmup_steps == pytest.approx(40)  # 0.1 * 400
    assert scheduler.wd_incr_steps == 400
    assert scheduler.use_checkpoint_opt_param_scheduler is False  # the config's default
    group = scheduler.optimizer.param_groups[0]
    for _ in range(10):
        scheduler.step(increment=4)
    assert group["lr"] == pytest.approx(1.0)  # 40 samples: end of warm-up
    for _ in range(10):
        scheduler.step(increment=4)
    # 80 samples: ratio (80 - 40) / 360 = 1/9; 0.1 + 8/9 * 0.9 = 0.9
    assert group["lr"] == pytest.approx(0.9)


def test_iteration_based_settings_are_multiplied_by_the_batch_size():
    config = OptimizerConfig(
        lr=1.0,
        lr_decay_iters=50,
        lr_warmup_iters=5,
        lr_warmup_init=0.5,
        lr_decay_style="WSD",
        lr_wsd_decay_style="cosine",
        lr_wsd_decay_iters=10,
        start_weight_decay=0.0,
        end_weight_decay=0.1,
        weight_decay_incr_style="linear",
    )
    scheduler = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=4, train_iters=100
    )
    assert scheduler.lr_decay_steps == 200
    assert scheduler.lr_warmup_steps == 20
    assert scheduler.wsd_decay_steps == 40
    assert scheduler.wd_incr_steps == 400  # train_iters, not lr_decay_iters
    assert scheduler.lr_wsd_decay_style == "cosine"
    assert (scheduler.start_wd, scheduler.end_wd) == (0.0, 0.1)
    assert scheduler.optimizer.param_groups[0]["lr"] == 0.5  # init_lr = lr_warmup_init


def test_sample_based():
    config = OptimizerConfig(lr=1.0, lr_warmup_fraction=0.01)
    scheduler = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=8, train_samples=1000
    )
    assert scheduler.lr_decay_steps == 1000
    assert scheduler.lr_warmup_steps == pytest.approx(10)  # 0.01 * 1000
    assert scheduler.wd_incr_steps == 1000

    config = OptimizerConfig(
        lr=1.0,
        lr_decay_samples=500,
        lr_warmup_samples=20,
        lr_decay_style="WSD",
        lr_wsd_decay_samples=100,
    )
    scheduler = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=8, train_samples=1000
    )
    assert (scheduler.lr_decay_steps, scheduler.lr_warmup_steps) == (500, 20)
    assert scheduler.wsd_decay_steps == 100
    assert scheduler.wd_incr_steps == 1000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "train_iters=None and train_samples=None"),
        ({"train_iters": 10, "train_samples": 80}, "train_iters=10 and train_samples=80"),
        ({"train_iters": 0}, "train_iters=0"),
        ({"train_samples": 0}, "train_samples=0"),
    ],
)
def test_needs_exactly_one_positive_length(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_optimizer_param_scheduler(
            OptimizerConfig(lr=1.0), _optimizer(), global_batch_size=8, **kwargs
        )


def test_needs_lr():
    with pytest.raises(ValueError, match="lr=None"):
        get_optimizer_param_scheduler(
            OptimizerConfig(), _optimizer(), global_batch_size=8, train_iters=10
        )


def test_a_longer_run_names_the_flag_that_resumes_it():
    """Resuming with a larger train_iters changes the derived decay length: by default
    (Megatron's too) that is refused, and the message says which flag goes on."""
    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2)
    saved = get_optimizer_param_scheduler(config, _optimizer(), global_batch_size=4, train_iters=10)
    saved.step(increment=40)
    longer = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=4, train_iters=20
    )
    with pytest.raises(ValueError) as error:
        longer.load_state_dict(saved.state_dict())
    message = str(error.value)
    assert message.startswith("lr_decay_steps=80 differs from the checkpoint's lr_decay_steps=40")
    assert "train_iters" in message and "--override-opt-param-scheduler" in message
    config.override_opt_param_scheduler = True
    longer = get_optimizer_param_scheduler(
        config, _optimizer(), global_batch_size=4, train_iters=20
    )
    longer.load_state_dict(saved.state_dict())
    assert (longer.num_steps, longer.lr_decay_steps) == (40, 80)
