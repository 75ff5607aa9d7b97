"""Megatron-LM flags without a field of their own: accepted without effect, renamed, or
refused with the reason (mp_train.megatron_flags)."""

import dataclasses

import pytest

from mp_train import parse_config
from mp_train.megatron_flags import IGNORED, REFUSED

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def _flag(dest: str, valued: bool) -> list[str]:
    return [f"--{dest.replace('_', '-')}", *(["1"] if valued else [])]


def test_ignored_flags_change_nothing(capsys):
    baseline = dataclasses.asdict(parse_config(MODEL))
    argv = [*MODEL]
    for dest, (valued, _) in IGNORED.items():
        argv += _flag(dest, valued)
    assert dataclasses.asdict(parse_config(argv)) == baseline
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "--use-mcore-models" in note


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_refused_flags_say_why(dest):
    valued, why = REFUSED[dest]
    with pytest.raises(ValueError) as error:
        parse_config([*MODEL, *_flag(dest, valued)])
    assert str(error.value) == f"--{dest.replace('_', '-')}: {why}"


def test_renamed_flags_set_our_fields():
    renamed = ["--norm-epsilon", "1e-6", "--ddp-bucket-size", "1000", "--use-flash-attn",
               "--no-position-embedding", "--override-opt_param-scheduler",
               "--ckpt-format", "torch_dist"]  # fmt: skip
    config = parse_config([*MODEL, *renamed])
    assert config.model.layernorm_epsilon == 1e-6
    assert config.optimizer.bucket_size == 1000
    assert config.model.attention_backend == "flash"
    assert config.model.position_embedding_type == "none"
    assert config.optimizer.override_opt_param_scheduler


def test_what_is_refused_or_contradicts():
    with pytest.raises(ValueError, match=r"--ckpt-format torch: .*mp-ckpt import-megatron"):
        parse_config([*MODEL, "--ckpt-format", "torch"])
    with pytest.raises(ValueError, match="--norm-epsilon 1e-06 and --layernorm-epsilon 1e-05"):
        parse_config([*MODEL, "--norm-epsilon", "1e-6", "--layernorm-epsilon", "1e-5"])


def test_help_lists_them(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = capsys.readouterr().out
    assert "Megatron-LM flags accepted without effect" in text
    assert "--no-rope-fusion" in text and "--use-torch-fsdp2" in text
