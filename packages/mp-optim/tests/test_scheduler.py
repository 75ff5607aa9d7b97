"""OptimizerParamScheduler against values worked out by hand.

Unless a test says otherwise the schedule is: init_lr 0, max_lr 1.0, min_lr 0.1,
warm-up 10 steps, decay ends at step 110 (so decay spans 100 steps), weight
decay from 0.1 to 0.5 over 100 steps. Cosine and square-root constants used:
cos(pi/4) = sqrt(0.5) = 0.70710678, 0.5**0.25 = 0.84089642.
"""

import pytest
import torch

from mp_optim.scheduler import OptimizerParamScheduler


class FakeOptimizer:
    def __init__(self, *groups):
        self.param_groups = list(groups) or [{}]


BASE = dict(
    init_lr=0.0,
    max_lr=1.0,
    min_lr=0.1,
    lr_warmup_steps=10,
    lr_decay_steps=110,
    lr_decay_style="linear",
    start_wd=0.1,
    end_wd=0.5,
    wd_incr_steps=100,
    wd_incr_style="linear",
)


def make(optimizer=None, **overrides):
    return OptimizerParamScheduler(optimizer or FakeOptimizer(), **(BASE | overrides))


def values_at(step, **overrides):
    """(lr, weight_decay) of the single group after `step` steps."""
    scheduler = make(**overrides)
    scheduler.step(step)
    group = scheduler.optimizer.param_groups[0]
    return group["lr"], group["weight_decay"]


def lr_at(step, **overrides):
    return values_at(step, **overrides)[0]


def wd_at(step, **overrides):
    return values_at(step, **overrides)[1]


# Learning rate.

WARMUP = [
    (0, 0.0),  # 0 + (1.0 - 0) * 0/10
    (5, 0.5),  # 1.0 * 5/10
    (10, 1.0),  # the boundary belongs to warm-up: 1.0 * 10/10
]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("step", "expected"), WARMUP)
def test_warmup_is_linear_from_init_lr(style, step, expected):
    assert lr_at(step, lr_decay_style=style) == pytest.approx(expected)


def test_warmup_starts_from_init_lr():
    # 0.2 + (1.0 - 0.2) * 5/10 = 0.6
    assert lr_at(0, init_lr=0.2) == pytest.approx(0.2)
    assert lr_at(5, init_lr=0.2) == pytest.approx(0.6)


@pytest.mark.parametrize("step", [11, 60, 110, 500])
def test_constant_stays_at_max_lr_even_past_decay(step):
    assert lr_at(step, lr_decay_style="constant") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (11, 0.991),  # ratio 1/100, coeff 0.99: 0.1 + 0.99 * 0.9
        (35, 0.775),  # ratio 0.25, coeff 0.75: 0.1 + 0.675
        (60, 0.55),  # ratio 0.5: 0.1 + 0.45
        (110, 0.1),  # ratio 1: min_lr
        (111, 0.1),  # past the decay: min_lr
    ],
)
def test_linear(step, expected):
    assert lr_at(step, lr_decay_style="linear") == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (35, 0.86819805),  # coeff 0.5 * (cos(pi/4) + 1) = 0.85355339; 0.1 + 0.9 * that
        (60, 0.55),  # coeff 0.5 * (cos(pi/2) + 1) = 0.5
        (85, 0.23180195),  # coeff 0.5 * (cos(3pi/4) + 1) = 0.14644661
        (110, 0.1),  # coeff 0.5 * (cos(pi) + 1) = 0
        (200, 0.1),
    ],
)
def test_cosine(step, expected):
    assert lr_at(step, lr_decay_style="cosine") == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (2, 0.5),  # warm-up: 1.0 * 2/4
        (4, 1.0),  # end of warm-up
        (16, 0.5),  # 1.0 * sqrt(4) / sqrt(16) = 2/4
        (100, 0.2),  # 2/10
        (900, 0.1),  # 2/30 = 0.0667 is below min_lr: clipped to 0.1
        (1001, 0.1),  # past the decay
    ],
)
def test_inverse_square_root(step, expected):
    kwargs = dict(lr_decay_style="inverse-square-root", lr_warmup_steps=4, lr_decay_steps=1000)
    assert lr_at(step, **kwargs) == pytest.approx(expected)


def test_inverse_square_root_without_warmup_treats_both_counts_as_at_least_one():
    kwargs = dict(lr_decay_style="inverse-square-root", lr_warmup_steps=0, lr_decay_steps=1000)
    assert lr_at(0, **kwargs) == pytest.approx(1.0)  # 1.0 * sqrt(1) / sqrt(1)
    assert lr_at(4, **kwargs) == pytest.approx(0.5)  # 1.0 * sqrt(1) / sqrt(4)
    assert lr_at(25, **kwargs) == pytest.approx(0.2)  # 1 / 5


# WSD: decay ends at 110 and anneals over its last 20 steps, so annealing
# starts at step 90; r = (step - 90) / 20.
WSD_COMMON = [
    (5, 0.5),  # warm-up
    (10, 1.0),
    (50, 1.0),  # stable
    (90, 1.0),  # last stable step
    (110, 0.1),  # r = 1: every style's coeff is 0
    (111, 0.1),  # past the decay
]
WSD_ANNEAL = {
    # r = 0.25 at step 95, r = 0.5 at step 100; lr = 0.1 + 0.9 * coeff.
    "linear": [(95, 0.775), (100, 0.55)],  # coeff 0.75, 0.5
    "cosine": [(95, 0.86819805), (100, 0.55)],  # coeff 0.85355339, 0.5
    # coeff 2 * 0.5**r - 1: 2 * 0.84089642 - 1 = 0.68179283; 2 * 0.70710678 - 1 = 0.41421356
    "exponential": [(95, 0.71361355), (100, 0.47279221)],
    # coeff 1 - sqrt(r): 0.5; 1 - 0.70710678 = 0.29289322
    "minus_sqrt": [(95, 0.55), (100, 0.36360390)],
}


@pytest.mark.parametrize(
    ("wsd_style", "step", "expected"),
    [(s, step, lr) for s, points in WSD_ANNEAL.items() for step, lr in WSD_COMMON + points],
)
def test_wsd(wsd_style, step, expected):
    kwargs = dict(lr_decay_style="WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert lr_at(step, **kwargs) == pytest.approx(expected)


# Weight decay (0.1 -> 0.5 over 100 steps).


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.1),
        (25, 0.2),  # 0.1 + 0.25 * 0.4
        (50, 0.3),
        (100, 0.5),
        (101, 0.5),
    ],
)
def test_weight_decay_linear(step, expected):
    assert wd_at(step, wd_incr_style="linear") == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.1),  # coeff 0.5 * (cos(pi) + 1) = 0
        (25, 0.15857864),  # coeff 0.5 * (cos(3pi/4) + 1) = 0.14644661; 0.1 + 0.4 * that
        (50, 0.3),  # coeff 0.5
        (75, 0.44142136),  # coeff 0.5 * (cos(pi/4) + 1) = 0.85355339
        (100, 0.5),
        (150, 0.5),
    ],
)
def test_weight_decay_cosine(step, expected):
    assert wd_at(step, wd_incr_style="cosine") == pytest.approx(expected)


@pytest.mark.parametrize("step", [0, 50, 100, 101])
def test_weight_decay_constant(step):
    assert wd_at(step, wd_incr_style="constant", start_wd=0.3, end_wd=0.3) == pytest.approx(0.3)


def test_get_wd_without_a_group_uses_the_defaults():
    scheduler = make()
    scheduler.step(60)
    assert scheduler.get_wd() == pytest.approx(0.34)  # 0.1 + 0.6 * 0.4


# Per-group overrides.


def test_groups_override_the_schedule_ends_and_scale_the_result():
    plain = {}
    scaled = {"max_lr": 2.0, "min_lr": 0.2, "lr_mult": 0.1, "wd_mult": 0.0}
    own_wd = {"start_wd": 0.0, "end_wd": 1.0, "wd_mult": 2.0}
    scheduler = make(FakeOptimizer(plain, scaled, own_wd))

    scheduler.step(5)  # warm-up; init_lr (0) is shared by every group
    assert plain["lr"] == pytest.approx(0.5)
    assert scaled["lr"] == pytest.approx(0.1)  # 2.0 * 5/10 = 1.0, times 0.1
    assert own_wd["weight_decay"] == pytest.approx(0.1)  # (0 + 0.05 * 1.0) * 2

    scheduler.step(55)  # step 60: decay ratio 0.5, wd ratio 0.6
    assert plain["lr"] == pytest.approx(0.55)
    assert plain["weight_decay"] == pytest.approx(0.34)  # 0.1 + 0.6 * 0.4
    assert scaled["lr"] == pytest.approx(0.11)  # (0.2 + 0.5 * 1.8) * 0.1
    assert scaled["weight_decay"] == 0.0
    assert own_wd["lr"] == pytest.approx(0.55)
    assert own_wd["weight_decay"] == pytest.approx(1.2)  # (0 + 0.6 * 1.0) * 2

    scheduler.step(100)  # past the decay: each group's own min_lr
    assert plain["lr"] == pytest.approx(0.1)
    assert scaled["lr"] == pytest.approx(0.02)


def test_sets_a_torch_optimizer_at_construction_and_on_step():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0, weight_decay=9.0)
    scheduler = make(sgd, init_lr=0.2)
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.2)
    assert sgd.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    scheduler.step(60)
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.55)


def test_sample_based_steps():
    # Warm-up over 16 samples, decay ends at 96 samples; 8 samples per step.
    scheduler = make(max_lr=1.0, min_lr=0.0, lr_warmup_steps=16, lr_decay_steps=96)
    group = scheduler.optimizer.param_groups[0]
    expected = {1: 0.5, 2: 1.0, 7: 0.5, 12: 0.0, 13: 0.0}  # 56 samples: (56-16)/80 = 0.5
    for iteration in range(1, 14):
        scheduler.step(increment=8)
        if iteration in expected:
            assert group["lr"] == pytest.approx(expected[iteration]), iteration
    assert scheduler.num_steps == 104


# Checkpoints.

STATE_AT_60 = {
    "max_lr": 1.0,
    "min_lr": 0.1,
    "lr_warmup_steps": 10,
    "lr_decay_steps": 110,
    "lr_decay_style": "linear",
    "num_steps": 60,
    "start_wd": 0.1,
    "end_wd": 0.5,
    "wd_incr_steps": 100,
    "wd_incr_style": "linear",
}


def test_state_dict():
    scheduler = make()
    scheduler.step(60)
    assert scheduler.state_dict() == STATE_AT_60


def test_state_dict_carries_wsd_settings():
    state = make(lr_decay_style="WSD", wsd_decay_steps=20, lr_wsd_decay_style="cosine").state_dict()
    assert state["wsd_decay_steps"] == 20
    assert state["lr_wsd_decay_style"] == "cosine"


def test_round_trip_restores_position_and_group_values():
    source = make()
    source.step(60)
    target = make(use_checkpoint_opt_param_scheduler=False)
    target.load_state_dict(source.state_dict())
    assert target.num_steps == 60
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    assert target.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.34)
    target.step(50)  # step 110
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("field", "class_value"),
    [
        ("max_lr", 2.0),
        ("min_lr", 0.0),
        ("lr_warmup_steps", 5),
        ("lr_decay_steps", 120),
        ("lr_decay_style", "cosine"),
        ("start_wd", 0.0),
        ("end_wd", 0.4),
        ("wd_incr_steps", 200),
        ("wd_incr_style", "cosine"),
    ],
)
def test_mismatch_without_flags_raises_naming_the_field(field, class_value):
    scheduler = make(use_checkpoint_opt_param_scheduler=False, **{field: class_value})
    with pytest.raises(ValueError, match=rf"{field}={class_value!r}.*{field}="):
        scheduler.load_state_dict(STATE_AT_60)


def test_override_keeps_the_class_values():
    scheduler = make(
        max_lr=2.0,
        lr_decay_style="cosine",
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    scheduler.load_state_dict(STATE_AT_60)
    assert scheduler.max_lr == 2.0
    assert scheduler.lr_decay_style == "cosine"
    assert scheduler.num_steps == 60  # the position always comes from the checkpoint
    # cosine at ratio 0.5: 0.1 + 0.5 * (2.0 - 0.1)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(1.05)


def test_use_checkpoint_takes_the_checkpoint_values():
    scheduler = make(max_lr=2.0, lr_decay_style="cosine", end_wd=0.9)
    scheduler.load_state_dict(STATE_AT_60)
    assert scheduler.max_lr == 1.0
    assert scheduler.lr_decay_style == "linear"
    assert scheduler.end_wd == 0.5
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    assert scheduler.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.34)


def test_wsd_settings_are_checked_on_load():
    wsd = dict(lr_decay_style="WSD", lr_wsd_decay_style="linear")
    state = make(wsd_decay_steps=20, **wsd).state_dict()
    scheduler = make(wsd_decay_steps=30, use_checkpoint_opt_param_scheduler=False, **wsd)
    with pytest.raises(ValueError, match="wsd_decay_steps=30"):
        scheduler.load_state_dict(state)


@pytest.mark.parametrize(
    "old_names",
    [
        {"start_lr": 1.0, "warmup_iter": 10, "end_iter": 110},
        {"max_lr": 1.0, "warmup_steps": 10, "decay_steps": 110},
    ],
)
def test_loads_older_megatron_key_names(old_names):
    # No weight-decay settings: older checkpoints did not save them.
    state = old_names | {"min_lr": 0.1, "decay_style": "cosine", "num_iters": 35}
    scheduler = make(lr_decay_style="cosine", use_checkpoint_opt_param_scheduler=False)
    scheduler.load_state_dict(state)
    assert scheduler.num_steps == 35
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.86819805)
    assert scheduler.end_wd == 0.5


def test_old_key_name_mismatch_is_reported_under_the_new_name():
    scheduler = make(use_checkpoint_opt_param_scheduler=False)
    state = {"start_lr": 3.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 110}
    with pytest.raises(ValueError, match=r"max_lr=1.0.*max_lr=3.0"):
        scheduler.load_state_dict(state | {"decay_style": "linear", "num_iters": 0})


def test_missing_key_raises():
    state = {k: v for k, v in STATE_AT_60.items() if k != "num_steps"}
    with pytest.raises(KeyError, match="num_iters, num_steps"):
        make().load_state_dict(state)


# Validation: every message names the argument and its value.


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_lr": -0.1}, "min_lr=-0.1"),
        ({"max_lr": 0.05}, "max_lr=0.05 must be >= min_lr=0.1"),
        ({"init_lr": 2.0}, "init_lr=2.0 must be <= max_lr=1.0"),
        ({"lr_decay_steps": 0}, "lr_decay_steps=0 must be > 0"),
        ({"lr_warmup_steps": 110}, "lr_warmup_steps=110 must be < lr_decay_steps=110"),
        ({"lr_decay_style": "step"}, "lr_decay_style='step'"),
        ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "linear"}, "wsd_decay_steps=None"),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 0, "lr_wsd_decay_style": "linear"},
            "wsd_decay_steps=0",
        ),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 111, "lr_wsd_decay_style": "linear"},
            "wsd_decay_steps=111",
        ),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 20}, "lr_wsd_decay_style=None"),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 20, "lr_wsd_decay_style": "step"},
            "lr_wsd_decay_style='step'",
        ),
        ({"start_wd": -0.1}, "start_wd=-0.1"),
        ({"end_wd": 0.05}, "end_wd=0.05 must be >= start_wd=0.1"),
        ({"wd_incr_style": "step"}, "wd_incr_style='step'"),
        ({"wd_incr_style": "constant"}, "wd_incr_style='constant' needs start_wd == end_wd"),
        ({"wd_incr_steps": 0}, "wd_incr_steps=0"),
        (
            {"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True},
            "override_opt_param_scheduler=True",
        ),
    ],
)
def test_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_wsd_annealing_as_long_as_the_decay_is_allowed():
    kwargs = dict(lr_decay_style="WSD", wsd_decay_steps=110, lr_wsd_decay_style="linear")
    assert lr_at(55, **kwargs) == pytest.approx(0.55)  # r = 55/110 = 0.5
