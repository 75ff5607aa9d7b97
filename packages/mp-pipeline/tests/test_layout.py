"""Megatron-LM's pipeline layout string (mp_pipeline.layout): repetitions unrolled as
Megatron's parser does, DeepSeek-V3's layouts from Megatron-LM's functional tests read as
the decoder layers of each virtual stage (stages of the loss, or the embedding, alone
included), Megatron's rules and mp's (the multi-token prediction modules beside the
loss) refused naming what is wrong, and the segments placed in virtual-stage order."""

import pytest

from mp_pipeline import accounted_segments, layout_segments, parse_layout, stage_layers


def test_repetitions_unroll_as_megatrons_parser_does():
    # Megatron's docstring example: "Ettt|(tt|)*29,m|L" -> [Ettt] + [tt] * 29 + [m], [L]
    stages = parse_layout("Ettt|(tt|)*29,m|L")
    assert stages == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert parse_layout("Et*3|(tt|)*2t*2mL") == ["Ettt", "tt", "tt", "ttmL"]
    assert parse_layout("E, t*2 | t L") == ["Ett", "tL"]


@pytest.mark.parametrize("layout,pp,mtp,segments", [
    # tests/functional_tests/test_cases/gpt/*deepseek*: 14 layers, MTP 1, PP 8
    ("Et*2|(tt|)*5t|tmL", 8, 1, [2, 2, 2, 2, 2, 2, 1, 1]),
    # ... and 14 layers, MTP 1, PP 2
    ("Et*7|t*7mL", 2, 1, [7, 7]),
    # ... 13 layers, MTP 1, PP 8, the last stage MTP and the loss alone
    ("Et|(tt|)*6mL", 8, 1, [1, 2, 2, 2, 2, 2, 2, 0]),
    # ... 15 layers, PP 8, the last stage the loss alone
    ("Et*3|(tt|)*6L", 8, None, [3, 2, 2, 2, 2, 2, 2, 0]),
    # virtual stages: 4 stages at PP 2, the first the embedding alone
    ("E|t|tt|tL", 2, None, [0, 1, 2, 1]),
])  # fmt: skip
def test_layouts_give_each_stages_decoder_layers(layout, pp, mtp, segments):
    assert layout_segments(layout, sum(segments), mtp, pp) == segments


@pytest.mark.parametrize("layout,pp,layers,mtp,message", [
    ("Ett|tt|tL", 2, 5, None, "3 stages: not a multiple of pipeline_model_parallel_size=2"),
    ("tEt|tL", 2, 3, None, "E .the embedding. must come first, once"),
    ("Ett|Lt", 2, 3, None, "L .the loss. must come last, once"),
    ("Ett|tL", 2, 4, None, r"holds 3 decoder layers \(t\), num_layers=4"),
    ("Ett|ttL", 2, 4, 1, r"holds 0 multi-token prediction modules \(m\), mtp_num_layers=1"),
    ("Ett|ttm|L", 3, 4, 1, "stage 1 .'ttm'. holds multi-token prediction modules"),
    ("Ett|tmtL", 2, 4, 1, "come after every decoder layer"),
    ("Ett|tgL", 2, 3, None, "stage 1 .'tgL'. has 'g'"),
])  # fmt: skip
def test_what_mp_cannot_place_is_refused(layout, pp, layers, mtp, message):
    with pytest.raises(ValueError, match=message):
        layout_segments(layout, layers, mtp, pp)


def test_segments_are_in_virtual_stage_order():
    # stage c * pp + r is chunk c of pipeline rank r: "Et|tt|t|tL" at PP 2
    segments = layout_segments("Et|tt|t|tL", 5, None, 2)
    held = {(rank, chunk): stage_layers(5, 2, rank, virtual_pipeline_model_parallel_size=2,
                                        vp_stage=chunk, segments=segments)
            for rank in range(2) for chunk in range(2)}  # fmt: skip
    assert [(held[r, c].offset, held[r, c].count) for r, c in
            [(0, 0), (1, 0), (0, 1), (1, 1)]] == [(0, 1), (1, 2), (3, 1), (4, 1)]  # fmt: skip
    assert held[0, 0].pre_process and held[1, 1].post_process


@pytest.mark.parametrize("layers,pp,vpp,embedding,loss,segments", [
    (6, 4, 2, True, True, [0, 1, 1, 1, 1, 1, 1, 0]),  # Megatron-LM's functional test
    (4, 3, None, True, True, [1, 2, 1]),
    (3, 2, None, True, False, [1, 2]),
    (5, 2, None, False, True, [3, 2]),
    (4, 2, 3, True, True, [0, 1, 1, 1, 1, 0]),
])  # fmt: skip
def test_the_embedding_and_the_loss_counted_as_layers(layers, pp, vpp, embedding, loss,
                                                      segments):  # fmt: skip
    assert accounted_segments(layers, pp, vpp, embedding, loss) == segments
    assert sum(segments) == layers


@pytest.mark.parametrize("layers,pp,vpp,message", [
    (4, 4, None, "num_layers . the embedding . the loss = 6 layers are not divisible by "
                 "pipeline_model_parallel_size=4"),
    (4, 2, 2, "6 layers, 3 per pipeline stage, are not divisible by "
              "virtual_pipeline_model_parallel_size=2"),
])  # fmt: skip
def test_counted_layers_must_divide(layers, pp, vpp, message):
    with pytest.raises(ValueError, match=message):
        accounted_segments(layers, pp, vpp, True, True)
