"""generate.py gives the same greedy text at TP 1 and TP 2 from one checkpoint (also a
Mamba-hybrid one), and at EP 1, EP 2, TP 2 and TP 2 x EP 2 from a mixture-of-experts
checkpoint trained at EP 2; a prompt in a batch continues as it does alone, and a stop
string ends its sequence."""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, HYBRID_OPTIONS
from mp_state.testing import run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"


def train_body(run_dir: str, config: Path = CONFIG, *layout: str):
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import main

    return main([
        "--config", str(config), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
        "--eval-interval", "none", "--save", run_dir, "--load", run_dir,
        "--tensorboard-dir", "none", "--num-workers", "0", "--lr-warmup-iters", "0",
        "--log-interval", "100", *layout,
    ])  # fmt: skip


def generate_body(run_dir: str, tp: int, *extra: str):
    import torch

    torch.set_num_threads(1)
    from mp_gpt.generate import run_generation

    return run_generation(["--load", run_dir, "--prompt", "1 2 3", "--max-new-tokens", "12",
                           "--tensor-model-parallel-size", str(tp), *extra])  # fmt: skip


@pytest.mark.multirank
def test_greedy_text_is_the_same_at_tp_1_and_2(tmp_path):
    run_on_ranks(train_body, 1, str(tmp_path), timeout=120)
    one = run_on_ranks(generate_body, 1, str(tmp_path), 1, timeout=120)
    two = run_on_ranks(generate_body, 2, str(tmp_path), 2, timeout=120)
    assert one[0] == two[0] == two[1]
    assert one[0].startswith("1 2 3 ")
    assert len(one[0].split()) == 3 + 12  # NullTokenizer text: the ids, spaced


@pytest.mark.multirank
def test_greedy_text_of_a_moe_checkpoint_is_the_same_at_ep_1_and_2_and_tp_2(tmp_path):
    moe = CONFIG.with_name("tiny-moe.yaml")
    run_on_ranks(train_body, 2, str(tmp_path), moe, "--expert-model-parallel-size", "2",
                 "--global-batch-size", "4", timeout=120)  # fmt: skip
    one = run_on_ranks(generate_body, 1, str(tmp_path), 1, timeout=120)
    two = run_on_ranks(generate_body, 2, str(tmp_path), 1, "--expert-model-parallel-size", "2",
                       timeout=120)  # fmt: skip
    # TP2 (generation runs without sequence parallelism: each tensor-parallel rank routes
    # a share of the tokens), and TP2 x EP2
    tp2 = run_on_ranks(generate_body, 2, str(tmp_path), 2, timeout=120)
    tp2_ep2 = run_on_ranks(generate_body, 4, str(tmp_path), 2, "--expert-model-parallel-size",
                           "2", timeout=120)  # fmt: skip
    assert one[0] == two[0] == two[1] == tp2[0] == tp2[1] == tp2_ep2[0]
    assert len(one[0].split()) == 3 + 12


def batch_body(run_dir: str, stops: list[str]):
    import torch

    torch.set_num_threads(1)
    from mp_gpt.generate import Generator
    from mp_gpt.generation import Sampling

    generator = Generator(run_dir)
    try:
        prompts = [generator.tokenizer.tokenize("1 2 3"), generator.tokenizer.tokenize("7")]
        done = generator.complete(prompts, max_new_tokens=12, sampling=[Sampling()] * 2,
                                  stop_strings=stops)  # fmt: skip
        return [(c.tokens, c.finish_reason, generator.text(c, stops)) for c in done]
    finally:
        generator.close()


@pytest.mark.multirank
def test_a_batch_equals_its_prompts_alone_and_stop_strings_end_a_sequence(tmp_path):
    run_on_ranks(train_body, 1, str(tmp_path), timeout=120)
    (first, why, text), _ = run_on_ranks(batch_body, 1, str(tmp_path), [], timeout=120)[0]
    assert why == "length" and len(first) == 12 and text == " ".join(map(str, first))
    # The batch's first sequence is what the command gives for that prompt alone.
    alone = run_on_ranks(generate_body, 1, str(tmp_path), 1, timeout=120)[0]
    assert alone == "1 2 3 " + text
    # A stop string (the fourth new token's text) ends the first sequence there.
    stop = f" {first[3]}"
    (cut, why, shown), _ = run_on_ranks(batch_body, 1, str(tmp_path), [stop], timeout=120)[0]
    assert why == "stop" and cut == first[: len(cut)] and len(cut) <= 4
    assert stop not in shown and " ".join(map(str, first)).startswith(shown)


def too_long_body(run_dir: str):
    import contextlib
    import io

    import torch

    torch.set_num_threads(1)
    from mp_gpt.generate import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["--load", run_dir, "--prompt", "1 2 3", "--max-new-tokens", "100"])
    return status, err.getvalue()


@pytest.mark.multirank
def test_a_prompt_too_long_for_the_model_is_one_line_and_status_2(tmp_path):
    run_on_ranks(train_body, 1, str(tmp_path), timeout=120)
    status, said = run_on_ranks(too_long_body, 1, str(tmp_path), timeout=120)[0]
    assert status == 2
    assert said == ("error: mp_gpt.generate: a prompt of 3 tokens and 100 new ones exceed the "
                    "model's 32 positions\n")  # fmt: skip


@pytest.mark.multirank
def test_greedy_text_of_a_hybrid_checkpoint_is_the_same_at_tp_1_and_2(tmp_path):
    """A Mamba-hybrid model (a Mamba layer, then attention) generates from its cached
    states, the same text at TP1 and TP2 (each rank its groups of Mamba heads)."""
    assert run_on_ranks(train_body, 1, str(tmp_path), CONFIG, *HYBRID_OPTIONS, timeout=120) == [0]
    one = run_on_ranks(generate_body, 1, str(tmp_path), 1, timeout=120)
    two = run_on_ranks(generate_body, 2, str(tmp_path), 2, timeout=120)
    assert one[0] == two[0] == two[1]
    assert one[0].startswith("1 2 3 ") and len(one[0].split()) == 3 + 12


@pytest.mark.multirank
def test_a_hybrid_checkpoint_with_pipeline_segments_generates_alike_at_pp_1_and_2(tmp_path):
    """A hybrid pattern with pipeline segments and a multi-token prediction module,
    "M*M|*/*M": trained on one rank (one stage holds both segments), it generates the same
    text there and at PP2 (three layers, then one; the module left out)."""
    layers = ["--num-layers", "4", "--hybrid-layer-pattern", "M*M|*/*M"]
    assert run_on_ranks(train_body, 1, str(tmp_path), CONFIG, *HYBRID_OPTIONS, *layers,
                        timeout=120) == [0]  # fmt: skip
    one = run_on_ranks(generate_body, 1, str(tmp_path), 1, timeout=120)
    two = run_on_ranks(generate_body, 2, str(tmp_path), 1, "--pipeline-model-parallel-size", "2",
                       timeout=120)  # fmt: skip
    assert one[0] == two[0] == two[1]
    assert one[0].startswith("1 2 3 ") and len(one[0].split()) == 3 + 12
