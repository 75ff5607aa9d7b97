"""`mp_train.validate` checks the layout against the model and the data, and refuses what
the model cannot run yet, with a one-line reason."""

from __future__ import annotations

import pytest

from mp_train import parse_config, validate

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
]  # fmt: skip


def _validate(*flags: str, world: int = 4) -> dict[str, int]:
    return validate(parse_config([*BASE, *flags]), world)


MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--disable-bias-linear"]
# A hybrid model: a Mamba layer and an attention layer (the pattern gives num_layers 2)
HYBRID = ["--hybrid-layer-pattern", "M*", "--mamba-num-heads", "8", "--mamba-head-dim", "8"]
# PP2 with two virtual stages per rank, 3 micro-batches per iteration (at DP2)
VPP = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
       "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "6"]  # fmt: skip
# A MoE run started from a dense checkpoint
UPCYCLED = ["--moe-use-upcycling", "--save", "/s", "--load", "/l"]
# Llama 4's chunked attention, in blocks of half the sequence
LLAMA4_CHUNKS = ["--position-embedding-type", "rope", "--attention-chunk-size", "16"]


def test_the_layouts_validate():
    assert _validate("--tensor-model-parallel-size", "2")["data_parallel_size"] == 2
    assert _validate("--pipeline-model-parallel-size", "2")["data_parallel_size"] == 2
    # An expert tensor-parallel size equal to the dense one is the default spelled out.
    flags = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    assert _validate(*flags)["data_parallel_size"] == 2
    # Context-parallel ranks are not data-parallel ones: 4 ranks at CP 2 are DP 2.
    cp = ["--context-parallel-size", "2", "--attention-dropout", "0"]
    assert _validate(*cp) == {"data_parallel_size": 2, "global_batch_size": 2,
                              "running_global_batch_size": 2, "num_microbatches": 1}  # fmt: skip
    assert _validate(*cp, "--cp-comm-type", "a2a")
    # The interleaved schedule with 3 micro-batches at PP2: in one group of 3.
    assert _validate(*VPP, "--microbatch-group-size-per-virtual-pipeline-stage", "3") == {
        "data_parallel_size": 2, "global_batch_size": 6, "running_global_batch_size": 6,
        "num_microbatches": 3}  # fmt: skip
    # Its exchanges overlapped with compute (the default, Megatron's older switch spells
    # it), in the warm-up and flush too, or waited for as posted.
    for flags, overlap, flush in (
        ([], True, False),
        (["--overlap-p2p-communication"], True, False),
        (["--overlap-p2p-communication-warmup-flush"], True, True),
        (["--no-overlap-p2p-communication"], False, False),
    ):
        config = parse_config([*BASE, *VPP, "--global-batch-size", "4", *flags])
        assert validate(config, 4)["num_microbatches"] == 2
        training = config.training
        assert training.overlap_p2p_comm == overlap, flags
        assert training.overlap_p2p_comm_warmup_flush == flush, flags
    # A hybrid model's Mamba layers take context parallelism and packed documents, also
    # with fewer groups than TP x CP ranks (each CP rank a share of one group's heads).
    assert _validate(*HYBRID, *cp, "--reset-attention-mask")["data_parallel_size"] == 2
    tp2 = ["--tensor-model-parallel-size", "2", "--mamba-num-groups", "2"]
    assert _validate(*HYBRID, *cp, *tp2, world=4)["data_parallel_size"] == 1
    # Experts split over 2 of 4 data-parallel ranks; expert TP 1 beside TP 2 + SP.
    ep = [*MOE, "--expert-model-parallel-size", "2"]
    assert _validate(*ep)["data_parallel_size"] == 4
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert _validate(*ep, *tp, "--expert-tensor-parallel-size", "1")["data_parallel_size"] == 2


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--expert-model-parallel-size", "2"], 4, r"^expert_model_parallel_size=2 needs num_moe"),
        (
            [*MOE, "--expert-model-parallel-size", "3"],
            6,
            r"^expert_model_parallel_size=3 does not divide num_moe_experts=4",
        ),
        (
            [*MOE, "--tensor-model-parallel-size", "2"],
            4,
            r"needs sequence_parallel=True",
        ),
        (
            ["--context-parallel-size", "3", "--attention-dropout", "0"],
            6,
            r"^seq_length=32 is not divisible by 2 x context_parallel_size=3: ",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
            ],
            8,
            r"^cp_comm_type='a2a' splits each tensor-parallel rank's 2 of num_query_groups=4 "
            r"\(tensor_model_parallel_size=2\) over context_parallel_size=4",
        ),
        (
            [*LLAMA4_CHUNKS, "--context-parallel-size", "2", "--attention-dropout", "0"],
            4,
            r"^attention_chunk_size=16 below seq_length=32 with context_parallel_size=2 is "
            r"not implemented: use seq_length <= 16$",
        ),
        (
            [*LLAMA4_CHUNKS, "--reset-attention-mask"],
            4,
            r"^attention_chunk_size=16 below seq_length=32 with samples of several documents",
        ),
        (
            VPP,
            4,
            r"^num_microbatches=3 in groups of microbatch_group_size_per_vp_stage=2 leaves a "
            r"last group of 1, .* \(the micro-batches per iteration: 3 = global_batch_size 6 "
            r"/ \(micro_batch_size 1 x dp 2\)\)$",
        ),
        (
            ["--microbatch-group-size-per-virtual-pipeline-stage", "4"],
            4,
            r"^microbatch_group_size_per_virtual_pipeline_stage=4 sets the interleaved "
            r"schedule's groups: it needs virtual_pipeline_model_parallel_size$",
        ),
        (
            UPCYCLED,
            4,
            r"^moe_use_upcycling turns a dense checkpoint into a MoE model: it needs "
            r"num_moe_experts$",
        ),
        ([*MOE, "--moe-use-upcycling", "--load", "/l"], 4, r"^moe_use_upcycling .* needs save"),
        (
            [*MOE, "--moe-use-upcycling", "--save", "/s"],
            4,
            r"^moe_use_upcycling starts from a dense model's checkpoint: give it with load",
        ),
        (
            [*MOE, *UPCYCLED, "--moe-upcycling-granularity", "3"],
            4,
            r"^moe_use_upcycling: num_moe_experts=4 is not a multiple of "
            r"moe_upcycling_granularity=3",
        ),
        (
            [*MOE, "--moe-upcycling-granularity", "2"],
            4,
            r"^moe_upcycling_granularity=2 cuts each dense MLP into experts when upcycling: "
            r"it needs moe_use_upcycling$",
        ),
        (
            ["--overlap-p2p-communication-warmup-flush"],
            4,
            r"^overlap_p2p_comm_warmup_flush overlaps the interleaved schedule's warm-up and "
            r"flush exchanges .* it needs virtual_pipeline_model_parallel_size and "
            r"overlap_p2p_comm \(Megatron-LM refuses it without them too\)$",
        ),
        (
            [*VPP, "--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush"],
            4,
            r"^overlap_p2p_comm_warmup_flush overlaps .* it needs "
            r"virtual_pipeline_model_parallel_size and overlap_p2p_comm",
        ),
        (
            [
                *HYBRID,
                "--context-parallel-size",
                "2",
                "--mamba-num-groups",
                "3",
                "--mamba-num-heads",
                "12",
                "--attention-dropout",
                "0",
            ],
            4,
            r"^mamba_num_groups=3, 12 Mamba heads at tensor_model_parallel_size=1: 3 Mamba "
            r"groups per tensor-parallel rank and context_parallel_size=2: one must divide "
            r"the other",
        ),
        (
            [*HYBRID, "--tensor-model-parallel-size", "4", "--mamba-num-groups", "2"],
            4,
            r"^mamba_num_groups=2 is not divisible by tensor_model_parallel_size=4",
        ),
        (
            ["--eval-interval", "none", "--start-eval-at-iter", "3"],
            1,
            r"^start_eval_at_iter=3 must be >= 0 and needs eval_interval \(given None\)",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--attention-dropout",
                "0",
            ],
            4,
            r"^cp_comm_type='a2a\+p2p' needs hierarchical_context_parallel_sizes",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--hierarchical-context-parallel-sizes",
                "2",
                "2",
                "--attention-dropout",
                "0",
            ],
            4,
            r"^hierarchical_context_parallel_sizes=\[2, 2\] applies to cp_comm_type="
            r"'a2a\+p2p', not 'p2p'",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "4",
                "1",
                "--num-query-groups",
                "2",
                "--attention-dropout",
                "0",
            ],
            4,
            r"^cp_comm_type='a2a\+p2p' splits each tensor-parallel rank's 2 of "
            r"num_query_groups=2 ",
        ),
    ],
)
def test_what_cannot_run_is_refused(flags, world, message):
    with pytest.raises(ValueError, match=message) as error:
        _validate(*flags, world=world)
    assert "\n" not in str(error.value)


def test_no_initialization_needs_a_checkpoint_to_load():
    with pytest.raises(ValueError, match="--no-initialization needs --load or --pretrained-ch"):
        _validate("--no-initialization")
    assert _validate("--no-initialization", "--load", "ckpt")["data_parallel_size"] == 4
    assert _validate("--no-initialization", "--pretrained-checkpoint", "hf")
    zero3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
             "--init-model-with-meta-device"]  # fmt: skip
    with pytest.raises(ValueError, match="with --init-model-with-meta-device: the meta-dev"):
        _validate("--no-initialization", "--load", "ckpt", *zero3)


def test_device_initialization_refuses_the_meta_device_build_and_cpu_initialization():
    assert _validate("--use-device-initialization")["data_parallel_size"] == 4
    assert _validate("--use-device-initialization", "--no-initialization", "--load", "ckpt")
    zero3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
             "--init-model-with-meta-device"]  # fmt: skip
    with pytest.raises(ValueError, match=r"^--use-device-initialization with --init-model-with"):
        _validate("--use-device-initialization", *zero3)
    with pytest.raises(ValueError, match="--use-cpu-initialization and --use-device-init"):
        _validate("--use-device-initialization", "--use-cpu-initialization")
    assert _validate("--use-cpu-initialization")  # mp's default: accepted without effect


def test_a_step_batch_size_schedule_gives_the_global_batch():
    schedule = ["--step-batch-size-schedule", "0:4 64:8"]  # 2 samples of 32 tokens
    assert _validate(*schedule)["global_batch_size"] == 8  # the largest
    for flags, message in (
        (["--global-batch-size", "8"], "step_batch_size_schedule with global_batch_size"),
        (["--rampup-batch-size", "4", "4", "8"], "with rampup_batch_size"),
        (["--step-batch-size-schedule", "32:4"], "the first threshold must be 0"),
    ):
        with pytest.raises(ValueError, match=message):
            _validate(*schedule, *flags)
    # with virtual stages, each size that divides must give a usable micro-batch count
    with pytest.raises(ValueError, match="micro-batches per iteration: 3 = global_batch_size 6"):
        _validate(*VPP[:-2], "--step-batch-size-schedule", "0:4 64:6")


# Per-split paths instead of BASE's mock data: one data source (Megatron-LM's rule).
SPLITS = ["--no-mock-data", "--train-data-path", "t"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--multiple-validation-sets", "--valid-data-path", "a", "b"],
     r"^multiple_validation_sets needs full_validation"),
    (["--multiple-validation-sets", "--full-validation", "--valid-data-path", "1", "a", "1", "b"],
     r"^multiple_validation_sets needs valid_data_path of two or more prefixes without weights"),
    (["--multiple-validation-sets", "--full-validation", "--valid-data-path", "a", "b",
      "--validation-set-names", "x"],
     r"^validation_set_names has 1 names for the 2 datasets of valid_data_path"),
    (["--validation-set-names", "x"], r"^validation_set_names=\['x'\] needs multiple_validation"),
])  # fmt: skip
def test_the_validation_sets_rules(flags, message):
    with pytest.raises(ValueError, match=message):
        _validate(*SPLITS, *flags, world=1)


def test_the_exit_signal_is_one_a_process_can_handle():
    with pytest.raises(ValueError, match="exit_signal='SIGKILL' must be a signal a process"):
        _validate("--exit-signal", "SIGKILL", world=1)
    with pytest.raises(ValueError, match="exit_signal='TERM' must be"):
        _validate("--exit-signal", "TERM", world=1)


def test_override_ckpt_iteration_needs_a_constant_global_batch():
    assert _validate("--override-ckpt-iteration", "3", "--global-batch-size", "4", world=1)
    with pytest.raises(ValueError, match=r"^--override-ckpt-iteration 3 counts the samples "
                       r"consumed by then as 3 x --global-batch-size, which "
                       r"--rampup-batch-size does not consume"):  # fmt: skip
        _validate("--override-ckpt-iteration", "3", "--rampup-batch-size", "2", "2", "8",
                  "--global-batch-size", "8", "--train-iters", "none", "--train-samples",
                  "100", "--lr-decay-samples", "80", world=1)  # fmt: skip
    with pytest.raises(ValueError, match="which --step-batch-size-schedule does not consume"):
        _validate("--override-ckpt-iteration", "3", "--step-batch-size-schedule", "0:4 64:8",
                  world=1)  # fmt: skip


def test_the_phase_transitions_rules():
    assert _validate("--phase-transition-iterations", "5,2", world=1)
    for flags, message in (
        (["--phase-transition-iterations", "2,x"], r"must be iterations separated by commas"),
        (["--phase-transition-iterations", "0,5"], r"must be distinct and >= 1"),
        (["--phase-transition-iterations", "5,5"], r"must be distinct and >= 1"),
        (["--phase-transition-iterations", "10"], r"a phase must end before train_iters=10"),
        (["--phase-transition-iterations", "5", "--step-batch-size-schedule", "0:4 64:8"],
         r"counts each phase's samples in global batches: not with step_batch_size_schedule"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            _validate(*flags, world=1)


def test_the_device_sync_interval_is_positive():
    assert _validate("--train-sync-interval", "5", world=1)
    with pytest.raises(ValueError, match="train_sync_interval=0 must be >= 1"):
        _validate("--train-sync-interval", "0", world=1)


def test_a_global_batch_the_layout_does_not_divide_is_decreased_when_asked():
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by "
                                         "micro_batch_size=1 x data_parallel_size=4"):  # fmt: skip
        _validate("--global-batch-size", "6")
    sizes = _validate("--global-batch-size", "6", "--decrease-batch-size-if-needed")
    assert (sizes["global_batch_size"], sizes["running_global_batch_size"]) == (6, 4)
    assert sizes["num_microbatches"] == 1
    assert (
        _validate("--global-batch-size", "8", "--decrease-batch-size-if-needed")[
            "running_global_batch_size"
        ]
        == 8
    )
    with pytest.raises(ValueError, match="global_batch_size=3 is below micro_batch_size=1 x "
                                         "data_parallel_size=4"):  # fmt: skip
        _validate("--global-batch-size", "3", "--decrease-batch-size-if-needed")
    with pytest.raises(ValueError, match="decreases a constant global batch: not with "
                                         "step_batch_size_schedule"):  # fmt: skip
        _validate("--decrease-batch-size-if-needed", "--step-batch-size-schedule", "0:4 64:8")


def test_two_handlers_of_one_signal_are_refused():
    assert _validate("--exit-signal-handler-for-training", world=1)
    assert _validate("--exit-signal-handler-for-training", "--exit-signal-handler",
                     "--exit-signal", "SIGUSR1", world=1)  # fmt: skip
    with pytest.raises(ValueError, match="exit_signal_handler_for_training and "
                                         "exit_signal_handler both act on SIGTERM"):  # fmt: skip
        _validate("--exit-signal-handler-for-training", "--exit-signal-handler", world=1)


@pytest.mark.parametrize(
    "flags, world, message",
    [(["--global-batch-size", "0"], 1, r"^global_batch_size=0 must be >= 1$"),
     (["--global-batch-size", "-2"], 2, r"^global_batch_size=-2 must be >= 1$"),
     (["--max-position-embeddings", "16"], 1,
      r"^max_position_embeddings=16 is below seq_length=32: the model's positions must cover"),
     (["--overlap-param-gather", "--use-distributed-optimizer"], 2,
      r"^overlap_param_gather=True needs overlap_grad_reduce=True"),
     ([*MOE, "--moe-router-topk", "1"], 1,
      r"^moe_router_topk=1 with softmax scores needs moe_router_pre_softmax=True"),
     (["--moe-ffn-hidden-size", "32"], 1, r"^moe_ffn_hidden_size=32 needs num_moe_experts$"),
     (["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16",
       "--position-embedding-type", "rope", "--attention-output-gate"], 1,
      r"^attention_output_gate=True with multi_latent_attention"),
     (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
       "--decoder-first-pipeline-num-layers", "4"], 2,
      r"leave 0 of num_layers=4 for the other 1 pipeline stage: each needs a layer"),
     (["--pipeline-model-parallel-size", "3", "--num-layers", "4",
       "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
      3, r"leave 0 of num_layers=4 for the other 1 pipeline stage"),
     (["--bf16", "--fp8-format", "e4m3", "--num-layers", "4", "--pipeline-model-parallel-size",
       "2", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3",
       "--num-layers-at-end-in-bf16", "0"], 2,
      r"^num_layers_at_start_in_bf16=3 exceeds a pipeline stage's 2 layers"),
     (["--deterministic-mode", "--cross-entropy-loss-fusion"], 1,
      r"^deterministic_mode=True needs cross_entropy_loss_fusion=False"),
     (["--save", "/nonexistent/run", "--save-interval", "4", "--save-retain-interval", "6"], 1,
      r"^save_retain_interval=6 is not a multiple of save_interval=4"),
     (["--lr-decay-samples", "100"], 1,
      r"^--lr-decay-samples in a --train-iters run: the schedule counts iterations; give "
      r"--lr-decay-iters$"),
     (["--lr-warmup-samples", "2"], 1,
      r"^--lr-warmup-samples in a --train-iters run: .* give --lr-warmup-iters or "),
     (["--train-iters", "none", "--train-samples", "100", "--lr-decay-iters", "10"], 1,
      r"^--lr-decay-iters in a --train-samples run: the schedule counts samples"),
     (["--train-iters", "none", "--train-samples", "100", "--lr-warmup-iters", "2"], 1,
      r"^--lr-warmup-iters in a --train-samples run"),
     (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1,
      r"^--lr-warmup-fraction 0.1 and --lr-warmup-iters 2 both give the warm-up: give one$"),
     (["--train-iters", "none", "--train-samples", "100", "--lr-warmup-fraction", "0.1",
       "--lr-warmup-samples", "2"], 1, r"and --lr-warmup-samples 2 both give the warm-up")],
)  # fmt: skip
def test_what_megatron_refuses_is_refused(flags, world, message):
    """Megatron-LM's validate_args refusals of flags mp keeps: each was accepted before, the
    scheduler then ignoring the option of the other unit, a positions table too short
    failing in the first forward, a zero global batch failing late on another field."""
    with pytest.raises(ValueError, match=message) as error:
        _validate(*flags, world=world)
    assert "\n" not in str(error.value)
    # Megatron spares a run that only evaluates the schedule's rules.
    if "--lr-decay-samples" in flags:
        assert _validate(*flags, "--skip-train", world=world)


def test_the_forms_megatron_allows_pass():
    assert _validate(*MOE, "--moe-router-topk", "1", "--moe-router-pre-softmax", world=1)
    assert _validate(*MOE, "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid",
                     world=1)  # fmt: skip
    assert _validate("--pipeline-model-parallel-size", "3", "--num-layers", "5",
                     "--decoder-first-pipeline-num-layers", "2",
                     "--decoder-last-pipeline-num-layers", "2", world=3)  # fmt: skip
    assert _validate("--max-position-embeddings", "32", world=1)
    assert _validate("--overlap-param-gather", "--use-distributed-optimizer",
                     "--overlap-grad-reduce", world=2)  # fmt: skip
    assert _validate("--save", "/nonexistent/run", "--save-interval", "4",
                     "--save-retain-interval", "8", world=1)  # fmt: skip
    assert _validate("--lr-warmup-fraction", "0.1", world=1)
    assert _validate("--train-iters", "none", "--train-samples", "100", "--lr-decay-samples",
                     "80", "--lr-warmup-samples", "8", world=1)  # fmt: skip


def test_an_expert_tensor_parallel_size_on_a_dense_model_warns_that_it_changes_nothing():
    """As Megatron-LM's own test lines set it (gpt3_mcore_te_tp2_pp2_cp2_etp4_...): the
    groups are built, with their divisibility rule, and unused."""
    flags = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"]
    with pytest.warns(UserWarning, match=r"expert_tensor_parallel_size=4 without num_moe_exp"):
        assert _validate(*flags, world=4)["data_parallel_size"] == 2


def test_upcycling_loads_neither_the_optimizer_nor_the_rng_state(capsys):
    """Megatron-LM's rule: an upcycled run starts from the dense model's weights alone."""
    config = parse_config([*BASE, *MOE, *UPCYCLED])
    assert config.checkpoint.no_load_optim and config.checkpoint.no_load_rng
    assert validate(config, 4)["data_parallel_size"] == 4
    printed = capsys.readouterr().err
    assert "moe_use_upcycling: no_load_optim is on" in printed, printed
    assert "moe_use_upcycling: no_load_rng is on" in printed, printed
