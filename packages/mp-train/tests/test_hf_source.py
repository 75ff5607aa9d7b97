"""A Hugging Face directory at --load / --pretrained-checkpoint: the model's settings and
the tokenizer from it, the given settings that disagree refused by name, the run's own
choices kept; which directory a run loads (Megatron-LM's pretrained-checkpoint rule); an
export directory that is not an earlier export refused before the run."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mp_ckpt import Checkpointer
from mp_train import parse_config
from mp_train.configuration.run_checks import check_input_files
from mp_train.errors import ConfigError
from mp_train.loop.starting_point import starting_point

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "vocab_size": 320, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.05,
}  # fmt: skip
RUN = ["--micro-batch-size", "1", "--seq-length", "64", "--mock-data", "--train-iters", "1"]


def hf_dir(tmp_path, tokenizer: bool = True, **change):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3 | change))
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "model.safetensors"))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")  # read when the run builds it
    return folder


def test_the_model_and_tokenizer_come_from_the_directory(tmp_path):
    folder = hf_dir(tmp_path)
    config = parse_config(["--load", str(folder), *RUN, "--hidden-dropout", "0.2",
                           "--num-attention-heads", "4"])  # fmt: skip
    model = config.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (3, 64, 96)
    assert (model.num_attention_heads, model.num_query_groups, model.kv_channels) == (4, 2, 32)
    assert (model.normalization, model.activation, model.qk_layernorm) == ("RMSNorm", "swiglu",
                                                                           True)  # fmt: skip
    assert not model.untie_embeddings_and_output_weights and model.rotary_base == 1000000
    assert model.init_method_std == 0.05 and model.attention_dropout == 0.0
    assert model.hidden_dropout == 0.2  # the run's own choice, given
    assert (config.data.padded_vocab_size, config.gpt.max_position_embeddings) == (320, 128)
    assert config.data.tokenizer_type == "HuggingFaceTokenizer"
    assert config.data.tokenizer_model == str(folder)
    named = parse_config(["--load", str(folder), *RUN, "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "300"])  # fmt: skip
    assert named.data.tokenizer_type == "NullTokenizer" and named.data.padded_vocab_size == 320


def test_settings_that_disagree_are_refused_by_name(tmp_path):
    folder = hf_dir(tmp_path)
    argv = ["--pretrained-checkpoint", str(folder), *RUN, "--num-layers", "2", "--swiglu",
            "--hidden-size", "32", "--padded-vocab-size", "384"]  # fmt: skip
    with pytest.raises(ValueError, match="differs from the Hugging Face model") as error:
        parse_config(argv)
    lines = str(error.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "num_layers", "hidden_size", "padded_vocab_size"]  # fmt: skip
    with pytest.raises(ValueError, match="320 embedding rows, not divisible by "
                       "tensor_model_parallel_size=3"):  # fmt: skip
        parse_config(["--load", str(folder), *RUN, "--tensor-model-parallel-size", "3"])


def test_a_hugging_face_model_is_not_trained_under_mup(tmp_path):
    """Its weights are a model without muP's multipliers: --use-mup would be another one."""
    folder = hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"use_mup: .*config.json False, given True"):
        parse_config(["--load", str(folder), *RUN, "--use-mup"])


def test_a_directory_without_tokenizer_needs_one_named(tmp_path):
    folder = hf_dir(tmp_path, tokenizer=False)
    with pytest.raises(ValueError, match=r"holds no tokenizer\.json: name the tokenizer"):
        parse_config(["--load", str(folder), *RUN])


def test_which_directory_a_run_loads(tmp_path):
    folder = hf_dir(tmp_path)
    empty, saved = tmp_path / "empty", tmp_path / "saved"
    Checkpointer(saved).save(7, {}, common={"iteration": 7})

    def start(*argv):
        return starting_point(parse_config([*argv, *RUN]).checkpoint)

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    hf, load_hf = str(folder), ("--pretrained-checkpoint", str(folder))
    assert start("--load", hf) == (hf, True)
    assert start("--load", str(empty), *load_hf) == (hf, True)
    assert start("--load", str(saved), *load_hf) == (str(saved), False)
    assert start("--load", str(saved), *load_hf, "--finetune") == (str(saved), True)
    on_saved = ("--pretrained-checkpoint", str(saved), *model)
    assert start("--load", str(empty), *on_saved) == (str(saved), True)
    assert start("--load", str(empty), *model) is None
    with pytest.raises(FileNotFoundError, match="nor under pretrained_checkpoint"):
        start("--load", str(empty), "--pretrained-checkpoint", str(empty), *model)


def test_a_run_loads_the_newer_of_its_non_persistent_and_persistent_checkpoints(tmp_path):
    load, fast = tmp_path / "load", tmp_path / "fast"
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]

    def start(*argv):
        return starting_point(parse_config([*model, *argv, *RUN]).checkpoint)

    Checkpointer(load).save(6, {}, common={"iteration": 6})
    kind = ("--non-persistent-ckpt-type", "global")
    assert start("--load", str(load), *kind) == (str(load), False)  # none under load/non_persistent
    Checkpointer(load / "non_persistent").save(6, {}, common={"iteration": 6})
    assert start("--load", str(load), *kind) == (str(load / "non_persistent"), False)  # a tie
    assert start("--load", str(load)) == (str(load), False)  # not looked for without the type
    assert start("--load", str(load), *kind, "--ckpt-step", "6") == (str(load), False)
    Checkpointer(fast).save(5, {}, common={"iteration": 5})
    elsewhere = ("--non-persistent-global-ckpt-dir", str(fast))
    assert start("--load", str(load), *kind, *elsewhere) == (str(load), False)  # older
    Checkpointer(fast).save(9, {}, common={"iteration": 9})
    assert start("--load", str(load), *kind, *elsewhere) == (str(fast), False)
    # With nothing under load (a first start, say), the non-persistent one is the start.
    empty = str(tmp_path / "empty")
    assert start("--load", empty, *kind, *elsewhere, "--finetune") == (str(fast), True)


def test_an_export_directory_must_be_new_empty_or_an_earlier_export(tmp_path):
    folder = hf_dir(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    config = parse_config(["--load", str(folder), *RUN, "--export-hf-dir",
                           str(tmp_path / "other")])  # fmt: skip
    with pytest.raises(ConfigError, match=r"--export-hf-dir .*other holds files and no config"):
        check_input_files(config)
    config = parse_config(["--load", str(folder), *RUN, "--export-hf-dir", str(folder)])
    check_input_files(config)  # an earlier export (a config.json): replaced at the end
