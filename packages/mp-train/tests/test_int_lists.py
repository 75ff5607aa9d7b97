"""Megatron-LM's layer patterns ("([0]+[1]*26)") read without eval, on the command line and
in YAML, for list-of-integer fields (moe_layer_freq)."""

import pytest

from mp_train import ConfigError, parse_config
from mp_train.configuration.int_lists import MAX_LENGTH, parse_int_list, parse_int_or_list

MOE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
       "--num-experts", "4", "--disable-bias-linear"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "want"),
    [("2", [2]), ("[1,0,1,0]", [1, 0, 1, 0]), ("([0]+[1]*3)", [0, 1, 1, 1]),
     ("[0]*1+[1]*3", [0, 1, 1, 1]), ("([1]*1+[0]*1)*2", [1, 0, 1, 0]), ("2*[1,0]", [1, 0, 1, 0]),
     (" [ 1 , 0 ] ", [1, 0]), ("[1]*(1+1)", [1, 1]), ("[]", [])],
)  # fmt: skip
def test_megatron_patterns_evaluate_as_python_would(text, want):
    assert parse_int_list(text) == want
    if "[" in text:
        assert eval(text) == want  # what Megatron-LM's eval() gives


@pytest.mark.parametrize(
    ("text", "says"),
    [('__import__("os").system("true")', "is not allowed"), ("[1]*-1", "'-1' is not allowed"),
     ("[1]+1", "+ joins two lists"), ("[1]*[2]", "* repeats a list"), ("[[1]]", "inside a list"),
     ("1.5", "'1.5' is not allowed"), ("[1]*10**9", "'10**9' is not allowed"),
     ("[True]", "'True' is not allowed"), ("[x]", "'x' is not allowed"), ("[1,", "is not"),
     (f"[1]*{MAX_LENGTH + 1}", "longer than"), ("(1,0)", "is not allowed")],
)  # fmt: skip
def test_anything_else_is_refused_naming_it(text, says):
    with pytest.raises(ValueError) as error:
        parse_int_list(text)
    assert says in str(error.value) and repr(text) in str(error.value)


def test_an_integer_stays_one_for_int_or_list():
    assert parse_int_or_list("3") == 3 and parse_int_or_list("[1]*2") == [1, 1]
    assert parse_int_list("3") == [3]


def test_moe_layer_freq_takes_megatrons_expressions_and_our_words():
    cases = [(["2"], [2]), (["1", "0", "1", "0"], [1, 0, 1, 0]),
             (["([0]+[1]*3)"], [0, 1, 1, 1]), (["[0]*2", "[1,1]"], [0, 0, 1, 1])]  # fmt: skip
    for words, want in cases:
        config = parse_config([*MOE, "--moe-layer-freq", *words])
        assert config.model.moe_layer_freq == want, words
    assert config.model.moe_layer_pattern() == [False, False, True, True]


def test_a_bad_expression_names_the_flag_and_the_value():
    with pytest.raises(ConfigError, match=r"argument --moe-layer-freq: '\[1\]\+1': \+ joins"):
        parse_config([*MOE, "--moe-layer-freq", "[1]+1"], exit_on_error=False)


def test_yaml_takes_the_expression_as_a_string(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('language_model:\n  moe_layer_freq: "([0]+[1]*3)"\n')
    config = parse_config([*MOE, "--config", str(path)])
    assert config.model.moe_layer_freq == [0, 1, 1, 1]
    path.write_text('language_model:\n  moe_layer_freq: "[1]*-4"\n')
    with pytest.raises(ValueError, match=r"run.yaml:2: language_model.moe_layer_freq: '\[1\]\*-4'"):
        parse_config([*MOE, "--config", str(path)])
