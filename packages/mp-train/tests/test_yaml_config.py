"""Run settings from a YAML file in Megatron-LM's layout."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from mp_train.configuration.arguments import parse_config
from mp_train.configuration.yaml_config import load_yaml_config

MEGATRON_YAML = """\
language_model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  ffn_hidden_size: 256
  normalization: RMSNorm
  activation: swiglu
  num_query_groups: null
model_parallel:
  tensor_model_parallel_size: 2
micro_batch_size: 4
global_batch_size: 32
lr: 3.0e-4
min_lr: 1e-5
train_iters: 100
data_path: [0.7, /data/web_text_document, 0.3, /data/code_text_document]
seq_length: 512
save: ${RUN_DIR}/ckpt
tokenizer_type: ${TOKENIZER:NullTokenizer}
"""


def _write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_megatron_layout_loads(tmp_path):
    path = _write(tmp_path, MEGATRON_YAML)
    settings = load_yaml_config(path, environ={"RUN_DIR": "/runs/a"})
    assert settings["model"] == {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
        "normalization": "RMSNorm", "activation": "swiglu", "num_query_groups": None,
    }  # fmt: skip
    assert settings["parallel"] == {"tensor_model_parallel_size": 2}
    assert settings["training"] == {"micro_batch_size": 4, "global_batch_size": 32,
                                    "train_iters": 100}  # fmt: skip
    assert settings["optimizer"] == {"lr": 3e-4, "min_lr": 1e-5}
    assert settings["data"]["data_path"] == [
        "0.7", "/data/web_text_document", "0.3", "/data/code_text_document",
    ]  # fmt: skip
    assert settings["gpt"] == {"seq_length": 512}
    assert settings["checkpoint"] == {"save": "/runs/a/ckpt"}
    assert settings["logging"] == {}


def test_the_whole_run_config_from_the_file(tmp_path):
    path = _write(tmp_path, MEGATRON_YAML)
    config = parse_config(["--config", str(path)], environ={"RUN_DIR": "/runs/a"})
    assert config.model.num_layers == 2 and config.model.normalization == "RMSNorm"
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.gpt.seq_length == 512
    assert config.checkpoint.save == "/runs/a/ckpt"
    assert config.data.tokenizer_type == "NullTokenizer"
    assert config.optimizer.min_lr == 1e-5


def test_the_command_line_overrides_the_file(tmp_path):
    path = _write(tmp_path, MEGATRON_YAML)
    config = parse_config(
        ["--yaml-cfg", str(path), "--num-layers", "6", "--lr", "1e-3", "--seq-length", "128"],
        environ={"RUN_DIR": "/runs/a"},
    )
    assert config.model.num_layers == 6
    assert config.model.hidden_size == 64  # from the file
    assert config.optimizer.lr == 1e-3
    assert config.gpt.seq_length == 128
    assert config.training.micro_batch_size == 4  # from the file


def test_environment_substitution_set_and_default(tmp_path):
    path = _write(tmp_path, """\
        save: ${RUN_DIR}/ckpt/${NAME:base}
        load: ${LOAD_DIR:/nowhere}
        micro_batch_size: ${MBS}
        tensorboard_dir: plain
    """)  # fmt: skip
    settings = load_yaml_config(path, environ={"RUN_DIR": "/r", "NAME": "n1", "MBS": "8"})
    assert settings["checkpoint"] == {"save": "/r/ckpt/n1", "load": "/nowhere"}
    assert settings["training"] == {"micro_batch_size": 8}  # converted after substitution
    assert settings["logging"] == {"tensorboard_dir": "plain"}
    settings = load_yaml_config(path, environ={"RUN_DIR": "/r", "MBS": "1"})
    assert settings["checkpoint"]["save"] == "/r/ckpt/base"


def test_an_unset_variable_is_named(tmp_path):
    path = _write(tmp_path, MEGATRON_YAML)
    with pytest.raises(ValueError, match="environment variable RUN_DIR is not set") as caught:
        load_yaml_config(path, environ={})
    assert f"{path}:18: save" in str(caught.value)


def test_an_unknown_key_is_named_with_file_and_line(tmp_path):
    path = _write(tmp_path, "micro_batch_size: 2\nhiden_size: 64\n")
    with pytest.raises(ValueError, match="unknown key") as caught:
        load_yaml_config(path)
    message = str(caught.value)
    assert f"{path}:2: hiden_size" in message
    assert "did you mean 'hidden_size'" in message


def test_a_megatron_setting_mp_lacks_is_named_as_one(tmp_path):
    path = _write(tmp_path, "language_model:\n  fp32_residual_connection: true\n")
    with pytest.raises(ValueError) as caught:
        load_yaml_config(path)
    assert str(caught.value) == (
        f"{path}:2: language_model.fp32_residual_connection: unknown key: no part of the run "
        "has a field 'fp32_residual_connection' (a Megatron-LM setting that mp does not "
        "implement)"
    )


def test_an_unknown_key_in_a_section(tmp_path):
    path = _write(tmp_path, "language_model:\n  num_layers: 2\n  flash: true\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: language_model.flash")):
        load_yaml_config(path)


def test_a_bad_value_is_named(tmp_path):
    path = _write(tmp_path, "language_model:\n  num_layers: many\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: language_model.num_layers")):
        load_yaml_config(path)
    path = _write(tmp_path, "transformer_impl: fast\n")
    with pytest.raises(ValueError, match="'fast' is not one of local, transformer_engine"):
        load_yaml_config(path)


def test_a_key_set_twice_is_refused(tmp_path):
    path = _write(tmp_path, "language_model:\n  seq_length: 128\nseq_length: 256\n")
    with pytest.raises(ValueError, match="set twice"):
        load_yaml_config(path)


def test_not_a_mapping(tmp_path):
    path = _write(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_yaml_config(path)
    path = _write(tmp_path, "a: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_yaml_config(path)
    assert all(v == {} for v in load_yaml_config(_write(tmp_path, "")).values())


def test_a_shared_name_sets_every_part(tmp_path):
    path = _write(tmp_path, """\
        language_model:
          num_layers: 2
          hidden_size: 64
          num_attention_heads: 4
          bf16: true
    """)  # fmt: skip
    settings = load_yaml_config(path)
    assert settings["model"]["bf16"] is True and settings["optimizer"]["bf16"] is True
    config = parse_config(["--config", str(path)])
    assert config.model.bf16 and config.optimizer.bf16
    assert config.model.params_dtype == config.optimizer.params_dtype == torch.bfloat16
    config = parse_config(["--config", str(path), "--no-bf16"])
    assert not config.model.bf16 and not config.optimizer.bf16
    assert config.model.params_dtype == torch.float32


def test_dtype_words_and_numbers_convert(tmp_path):
    path = _write(tmp_path, """\
        params_dtype: bf16
        train_samples: 1e6
        adam_beta2: 1
        split: 98,2,0
        mock_data: yes
    """)  # fmt: skip
    settings = load_yaml_config(path)
    assert settings["model"]["params_dtype"] == settings["optimizer"]["params_dtype"]
    assert settings["model"]["params_dtype"] == torch.bfloat16
    assert settings["training"]["train_samples"] == 1_000_000
    assert settings["optimizer"]["adam_beta2"] == 1.0
    assert isinstance(settings["optimizer"]["adam_beta2"], float)
    assert settings["data"] == {"split": "98,2,0", "mock_data": True}


def test_group_query_attention_over_a_file(tmp_path):
    path = _write(tmp_path, MEGATRON_YAML)  # num_query_groups: null
    environ = {"RUN_DIR": "/r"}
    config = parse_config(["--config", str(path), "--group-query-attention"], environ=environ)
    assert config.model.num_query_groups == 1
    text = MEGATRON_YAML.replace("num_query_groups: null", "num_query_groups: 2")
    path = _write(tmp_path, text, "gqa.yaml")
    config = parse_config(["--config", str(path), "--group-query-attention"], environ=environ)
    assert config.model.num_query_groups == 2


def test_a_window_and_its_pattern_from_yaml(tmp_path):
    path = _write(tmp_path, """\
        language_model:
          num_layers: 4
          hidden_size: 64
          num_attention_heads: 4
          window_size: [127, 0]
          window_attn_skip_freq: "[1,1,1,0]"
        """)  # fmt: skip
    config = parse_config(["--config", str(path)])
    assert config.model.window_size == (127, 0)
    assert config.model.window_attn_skip_freq == [1, 1, 1, 0]
    path = _write(tmp_path, """\
        language_model:
          num_layers: 4
          hidden_size: 64
          num_attention_heads: 4
          window_size: 127,0
          window_attn_skip_freq: [1, 0, 1, 0]
        """)  # fmt: skip
    config = parse_config(["--config", str(path)])
    assert (config.model.window_size, config.model.window_attn_skip_freq) == (
        (127, 0),
        [1, 0, 1, 0],
    )
