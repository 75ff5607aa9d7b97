"""Megatron-LM flags without a field of their own: accepted without effect, renamed, or
refused with the reason (mp_train.configuration.megatron_flags)."""

import dataclasses

import pytest

from mp_train import ConfigError, build_parser, parse_config, pipeline_segments, validate
from mp_train.configuration.megatron_aliases import PRESETS
from mp_train.configuration.megatron_flag_names import MEGATRON_FLAGS
from mp_train.configuration.megatron_flags import IGNORED, REFUSED

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def _flag(dest: str, valued: bool) -> list[str]:
    return [f"--{dest.replace('_', '-')}", *(["1"] if valued else [])]


def test_ignored_flags_change_nothing(capsys):
    # (under sequence parallelism, which --tp-comm-overlap needs, as in Megatron-LM)
    model = [*MODEL, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    baseline = dataclasses.asdict(parse_config(model))
    argv = [*model]
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
               "--override-opt_param-scheduler", "--ckpt-format", "torch_dist"]  # fmt: skip
    config = parse_config([*MODEL, *renamed])
    assert config.model.layernorm_epsilon == 1e-6
    assert config.optimizer.bucket_size == 1000
    assert config.model.attention_backend == "flash"
    assert config.optimizer.override_opt_param_scheduler


def test_megatrons_negative_spellings_clear_our_switches():
    config = parse_config(MODEL)
    assert config.training.manual_gc_eval and config.logging.barrier_with_L1_time
    assert config.logging.log_loss_scale_to_tensorboard and config.model.fp8_wgrad
    for flags in (["--no-manual-gc-eval"], ["--disable-manual-gc-eval"]):
        assert not parse_config([*MODEL, *flags]).training.manual_gc_eval
    negated = ["--no-barrier-with-level-1-timing", "--disable-log-loss-scale-to-tensorboard"]
    config = parse_config([*MODEL, *negated])
    assert not config.logging.barrier_with_L1_time
    assert not config.logging.log_loss_scale_to_tensorboard
    with pytest.raises(ValueError, match="fp8_wgrad=False needs fp8"):  # it did clear it
        parse_config([*MODEL, "--disable-fp8-wgrad"])


def test_muon_flags_set_the_optimizer_fields():
    muon = ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov",
            "--muon-no-split-qkv", "--muon-scale-mode", "unit_rms_norm",
            "--muon-extra-scale-factor", "0.2", "--muon-num-ns-steps", "6",
            "--muon-coefficient-type", "polar_express", "--muon-fp32-matmul-prec", "high",
            "--muon-tp-mode", "distributed", "--use-distributed-optimizer"]  # fmt: skip
    optimizer = parse_config([*MODEL, *muon]).optimizer
    assert optimizer.optimizer == "muon" and optimizer.muon_momentum == 0.95
    assert optimizer.muon_nesterov and not optimizer.muon_split_qkv
    assert (optimizer.muon_scale_mode, optimizer.muon_extra_scale_factor) == ("unit_rms_norm", 0.2)
    assert (optimizer.muon_num_ns_steps, optimizer.muon_coefficient_type) == (6, "polar_express")
    assert (optimizer.muon_fp32_matmul_prec, optimizer.muon_tp_mode) == ("high", "distributed")
    # Megatron's rule: the distributed optimizer of Muon is the layer-wise one
    assert optimizer.use_layer_wise_distributed_optimizer
    assert not optimizer.use_distributed_optimizer
    with pytest.raises(ValueError, match="torch has no such float32 matmul precision"):
        parse_config([*MODEL, "--optimizer", "muon", "--muon-fp32-matmul-prec", "low"])


def test_no_position_embedding_keeps_rope_as_megatron_does():
    # Llama 3.x's lines: the deprecated flag beside RoPE leaves RoPE on (and its scaling).
    for rope in (["--use-rotary-position-embeddings"], ["--position-embedding-type", "rope"]):
        config = parse_config([*MODEL, *rope, "--no-position-embedding", "--use-rope-scaling"])
        assert config.model.position_embedding_type == "rope" and config.model.use_rope_scaling
    for other in ([], ["--position-embedding-type", "none"]):
        with pytest.raises(ValueError, match="--no-position-embedding with position_embedding"):
            parse_config([*MODEL, *other, "--no-position-embedding"])


def test_sequence_parallel_is_off_without_tensor_parallelism(capsys):
    assert not parse_config([*MODEL, "--sequence-parallel"]).model.sequence_parallel
    assert "sequence parallelism is off (as in Megatron-LM)" in capsys.readouterr().err
    two = parse_config([*MODEL, "--sequence-parallel", "--tensor-model-parallel-size", "2"])
    assert two.model.sequence_parallel


def test_fp16s_dynamic_loss_scale_leaves_the_nan_check_to_the_scaler(capsys):
    """Megatron-LM's rule: under dynamic loss scaling an inf or nan is the scaler's signal,
    so check_for_nan_in_loss_and_grad is off; a static --loss-scale keeps it."""
    assert not parse_config([*MODEL, "--fp16"]).training.check_for_nan_in_loss_and_grad
    assert "check_for_nan_in_loss_and_grad is off" in capsys.readouterr().err
    static = parse_config([*MODEL, "--fp16", "--loss-scale", "1024"])
    assert static.training.check_for_nan_in_loss_and_grad
    assert parse_config([*MODEL, "--bf16"]).training.check_for_nan_in_loss_and_grad


def test_a_hybrid_pattern_gives_the_layers_and_no_experts_is_dense(capsys):
    """Megatron-LM's rules: the pattern's layer count wins over --num-layers (with a
    warning, a note here; mp refused the pair), --num-experts 0 is a dense model and a
    negative capacity factor none."""
    mamba = ["--mamba-num-heads", "8", "--mamba-head-dim", "8"]
    config = parse_config([*MODEL, *mamba, "--hybrid-layer-pattern", "M*M*"])  # MODEL: 2
    assert config.model.num_layers == 4
    assert "num_layers=2 is ignored for the pattern's 4 decoder layers" in capsys.readouterr().err
    assert parse_config([*MODEL, "--num-experts", "0"]).model.num_moe_experts is None
    # A negative capacity factor is no capacity: no token is dropped.
    moe = [*MODEL, "--num-experts", "4", "--disable-bias-linear"]
    uncapped = parse_config([*moe, "--moe-expert-capacity-factor", "-1"]).model
    assert uncapped.moe_expert_capacity_factor is None
    # Without experts, a MoE width beside a dense layer pattern is dropped with a note.
    for freq in ("2", "([0,1]*1)"):
        dense = parse_config([*MODEL, "--moe-ffn-hidden-size", "32", "--moe-layer-freq", freq])
        assert dense.model.moe_ffn_hidden_size is None
    assert "moe_ffn_hidden_size=32 without num_moe_experts: dropped" in capsys.readouterr().err


def test_skipping_training_loads_no_optimizer_state(capsys):
    """Megatron-LM's rule: --skip-train sets --no-load-optim (a checkpoint saved with
    --no-save-optim evaluates)."""
    assert parse_config([*MODEL, "--skip-train"]).checkpoint.no_load_optim
    assert "no_load_optim is on" in capsys.readouterr().err
    assert not parse_config(MODEL).checkpoint.no_load_optim


def test_a_refused_flag_is_named_before_unknown_flags():
    line = [*MODEL, "--mamba-unknown-size", "3", "--fp8-param-gather"]
    with pytest.raises(ValueError, match="--fp8-param-gather: FP8 parameters and their all-"):
        parse_config(line, exit_on_error=False)
    with pytest.raises(ConfigError, match="unrecognized arguments: --mamba-unknown-size 3"):
        parse_config(line[:-1], exit_on_error=False)


def test_a_megatron_flag_mp_lacks_is_named_as_one_and_a_typo_is_not():
    # Flags of megatron-core 0.19.2's parser that mp does not take (megatron_flag_names.py).
    lacking = ["--fp32-residual-connection", "--grpo-group-size=8", "--freeze-all-layers"]
    for flag in lacking:
        name = flag.split("=")[0]
        assert name in MEGATRON_FLAGS
        assert not any(name in action.option_strings for action in build_parser()._actions)
    with pytest.raises(ConfigError) as raised:
        parse_config([*MODEL, "--mamba-unknown-size", "3", *lacking], exit_on_error=False)
    assert str(raised.value).startswith(
        "unrecognized arguments: --mamba-unknown-size 3 --fp32-residual-connection "
        "--grpo-group-size=8 --freeze-all-layers (--fp32-residual-connection, "
        "--grpo-group-size, --freeze-all-layers: Megatron-LM flags that mp does not "
        "implement; docs/migrating-from-megatron.md lists the ones it takes)"
    )
    with pytest.raises(ConfigError, match=r"--fp32-residual-connection: a Megatron-LM flag "):
        parse_config([*MODEL, "--fp32-residual-connection"], exit_on_error=False)
    with pytest.raises(ConfigError) as raised:  # not Megatron's: argparse's message alone
        parse_config([*MODEL, "--fp32-residual"], exit_on_error=False)
    assert "Megatron-LM" not in str(raised.value)


def test_the_megatron_flag_list_holds_flags_mp_takes_under_megatrons_names():
    taken = {name for action in build_parser()._actions for name in action.option_strings}
    assert len(MEGATRON_FLAGS) > 800
    for name in ("--tensor-model-parallel-size", "--use-distributed-optimizer",
                 "--tp-comm-overlap", "--use-mcore-models", "--mock-data"):  # fmt: skip
        assert name in MEGATRON_FLAGS and name in taken, name
    assert "--config" not in MEGATRON_FLAGS  # mp's own (Megatron's is --yaml-cfg)


def test_hybrid_model_flags():
    """ModelOpt's model types, Megatron's older pattern flag, the layers from the pattern."""
    hybrid = ["--hidden-size", "64", "--num-attention-heads", "4", "--mamba-num-heads", "8",
              "--mamba-head-dim", "16", "--mamba-num-groups", "2"]  # fmt: skip
    with pytest.raises(ValueError, match="--export-model-type HybridModel: a hybrid model "
                                         "needs its layers, --hybrid-layer-pattern"):  # fmt: skip
        parse_config([*MODEL, "--export-model-type", "HybridModel"])
    parse_config([*MODEL, "--export-model-type", "GPTModel"])
    config = parse_config([*hybrid, "--hybrid-override-pattern", "M*-M",
                           "--export-model-type", "HybridModel"])  # fmt: skip
    assert (config.model.hybrid_layer_pattern, config.model.num_layers) == ("M*-M", 4)
    with pytest.raises(ValueError, match="--hybrid-override-pattern and --hybrid-layer-pattern: "
                                         "give one"):  # fmt: skip
        parse_config([*hybrid, "--hybrid-override-pattern", "M*", "--hybrid-layer-pattern", "M*"])
    # The pattern's count wins over --num-layers, with a note (Megatron-LM warns).
    config = parse_config([*hybrid, "--num-layers", "3", "--hybrid-layer-pattern", "M*"])
    assert config.model.num_layers == 2


def test_hybrid_multi_token_prediction_flags(capsys):
    """The unified pattern's modules (the decoder's layers before "/"), and Megatron's older
    --mtp-hybrid-override-pattern, which becomes them with --mtp-num-layers."""
    hybrid = ["--hidden-size", "64", "--num-attention-heads", "4", "--mamba-num-heads", "8",
              "--mamba-head-dim", "16", "--mamba-num-groups", "2",
              "--position-embedding-type", "none"]  # fmt: skip
    config = parse_config([*hybrid, "--hybrid-layer-pattern", "M*M-/*-/*-"])
    assert (config.model.num_layers, config.model.mtp_num_layers) == (4, 2)
    older = parse_config([*hybrid, "--hybrid-layer-pattern", "M*M-", "--mtp-num-layers", "2",
                          "--mtp-hybrid-override-pattern", "*-"])  # fmt: skip
    assert older.model == config.model
    capsys.readouterr()
    # Without --mtp-num-layers (or with a unified pattern) it changes nothing, as in Megatron.
    plain = parse_config([*hybrid, "--hybrid-layer-pattern", "M*M-",
                          "--mtp-hybrid-override-pattern", "*-"])  # fmt: skip
    assert plain.model.hybrid_layer_pattern == "M*M-" and plain.model.mtp_num_layers is None
    assert "without effect: --mtp-hybrid-override-pattern" in capsys.readouterr().err
    gpt = parse_config([*MODEL, "--position-embedding-type", "rope", "--mtp-num-layers", "1",
                        "--mtp-hybrid-override-pattern", "*-"])  # fmt: skip
    assert gpt.model.hybrid_layer_pattern is None and gpt.model.mtp_num_layers == 1


def test_padded_vocab_size_is_checked_against_tensor_parallelism():
    assert parse_config([*MODEL, "--padded-vocab-size", "1000"]).data.padded_vocab_size == 1000
    config = parse_config([*MODEL, "--padded-vocab-size", "1001",
                           "--tensor-model-parallel-size", "2"])  # fmt: skip
    with pytest.raises(ValueError, match="padded_vocab_size=1001 is not divisible by tensor"):
        validate(config, 2)


def test_enable_gpt_oss_stands_for_yarn_or_names_what_is_missing():
    parser = build_parser()
    flags = PRESETS["enable_gpt_oss"][1]
    if all(word in parser._option_string_actions for word in flags if word.startswith("--")):
        config = parse_config([*MODEL, "--enable-gpt-oss", "--yarn-beta-fast", "8"])
        assert config.model.position_embedding_type == "yarn"
        assert config.model.yarn_beta_fast == 32  # set over the command line, as Megatron does
    else:
        with pytest.raises(ValueError, match="--enable-gpt-oss stands for gpt-oss's YaRN"):
            parse_config([*MODEL, "--enable-gpt-oss"])


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


def test_hybrid_pipeline_segments_give_the_virtual_stages():
    """Megatron's "|" in the decoder's pattern: one segment per virtual pipeline stage."""
    hybrid = ["--hidden-size", "64", "--num-attention-heads", "4", "--mamba-num-heads", "8",
              "--mamba-head-dim", "16", "--mamba-num-groups", "2",
              "--position-embedding-type", "none"]  # fmt: skip
    pp2 = ["--pipeline-model-parallel-size", "2"]
    two = parse_config([*hybrid, *pp2, "--hybrid-layer-pattern", "M*M|*", "--train-iters", "1",
                        "--mock-data"])  # fmt: skip
    assert two.model.num_layers == 4 and two.parallel.virtual_pipeline_model_parallel_size is None
    assert pipeline_segments(two) == [3, 1]
    validate(two, 2)
    four_stages = dataclasses.replace(two.parallel, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="has 2 pipeline segments, not one per virtual stage"):
        validate(dataclasses.replace(two, parallel=four_stages), 2)
    four = parse_config([*hybrid, *pp2, "--hybrid-layer-pattern", "M|*M|-|M*/*-"])
    assert four.parallel.virtual_pipeline_model_parallel_size == 2
    assert pipeline_segments(four) == [1, 2, 1, 2] and four.model.mtp_num_layers == 1
    # one pipeline stage holds every segment (a checkpoint trained so loads on one rank)
    one = parse_config([*hybrid, "--hybrid-layer-pattern", "M|*M|-|M*"])
    assert (
        pipeline_segments(one) is None and one.parallel.virtual_pipeline_model_parallel_size is None
    )
    for extra, message in (
        (["--hybrid-layer-pattern", "M|*|M"], "has 3 pipeline segments: not a multiple of"),
        (["--hybrid-layer-pattern", "M*|M*", "--decoder-first-pipeline-num-layers", "1"],
         "drop --decoder-first-pipeline-num-layers"),
        (["--hybrid-layer-pattern", "M*|M*", "--virtual-pipeline-model-parallel-size", "2"],
         "virtual pipeline stages 1 per rank, not --virtual-pipeline-model-parallel-size 2"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_config([*hybrid, *pp2, *extra])


def test_weight_decay_of_the_query_and_key_norms_both_spellings():
    """--apply-wd-to-qk-layernorm and Megatron's --no-weight-decay-cond-type
    apply_wd_to_qk_layernorm set the same field (Qwen3-Next's functional test line)."""
    assert not parse_config(MODEL).optimizer.apply_wd_to_qk_layernorm
    for flags in (["--apply-wd-to-qk-layernorm"],
                  ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"]):  # fmt: skip
        assert parse_config([*MODEL, *flags]).optimizer.apply_wd_to_qk_layernorm
    with pytest.raises(ValueError, match="disagree"):
        parse_config([*MODEL, "--no-apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type",
                      "apply_wd_to_qk_layernorm"])  # fmt: skip
    assert parse_config([*MODEL, "--deterministic-mode"]).training.deterministic_mode
    other = parse_config([*MODEL, "--pipeline-model-parallel-size", "2",
                          "--num-virtual-stages-per-pipeline-rank", "2",
                          "--ddp-average-in-collective", "--use-tp-pp-dp-mapping"])  # fmt: skip
    assert other.parallel.virtual_pipeline_model_parallel_size == 2
    assert other.optimizer.average_in_collective
    assert other.parallel.order == "tp-cp-ep-pp-dp"
    with pytest.raises(ValueError, match="--use-tp-pp-dp-mapping and --order tp-cp-ep-dp-pp"):
        parse_config([*MODEL, "--use-tp-pp-dp-mapping", "--order", "tp-cp-ep-dp-pp"])


def test_recompute_modules_take_megatrons_list():
    """--recompute-modules takes Megatron's space-separated names."""
    line = [*MODEL, "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
            "mlp"]  # fmt: skip
    model = parse_config(line).model
    assert model.recompute_modules == ["core_attn", "mlp"] and model.recomputes("mlp")
    assert not parse_config(MODEL).model.recomputes("core_attn")  # no selective recompute


def test_shared_experts_recompute_refuses_the_overlap_flag():
    """Megatron-LM's rule: --recompute-modules shared_experts and --moe-shared-expert-overlap
    exclude each other (the overlap flag alone is accepted without effect)."""
    moe = [*MODEL, "--num-experts", "4", "--moe-shared-expert-intermediate-size", "32",
           "--disable-bias-linear",
           "--recompute-granularity", "selective", "--moe-shared-expert-overlap"]  # fmt: skip
    assert parse_config([*moe, "--recompute-modules", "layernorm"]).model.recomputes(
        "layernorm")  # fmt: skip
    with pytest.raises(ValueError, match="shared_experts cannot work with --moe-shared-expert"):
        parse_config([*moe, "--recompute-modules", "shared_experts"])


def test_megatron_fsdp_gradient_dtypes_set_grad_reduce_in_bf16():
    """--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype: one dtype for
    accumulating and reducing (auto: the model's for main, main's for comm)."""
    fsdp = [*MODEL, "--use-megatron-fsdp", "--bf16"]
    main, comm = "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype"
    cases = {(main, "bf16", comm, "bf16"): True, (main, "fp32"): False, (comm, "auto"): True,
             (main, "fp32", comm, "fp32"): False}  # fmt: skip
    for extra, bf16 in cases.items():
        assert parse_config([*fsdp, *extra]).optimizer.grad_reduce_in_bf16 is bf16, extra
    for extra, message in {
        (main, "fp32", comm, "bf16"): "in one dtype, fp32 or bf16",
        (main, "fp16"): "in one dtype",
        (main, "bf16", "--no-grad-reduce-in-bf16"): "disagree",
    }.items():  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_config([*fsdp, *extra])
    with pytest.raises(ValueError, match="need --use-megatron-fsdp"):
        parse_config([*MODEL, "--bf16", main, "bf16"])
    params = "--megatron-fsdp-main-params-dtype"
    parse_config([*fsdp, params, "fp32"])  # mp's own
    for value in ("bf16", "auto"):  # auto: the bf16 model's dtype
        with pytest.raises(ValueError, match="mp's FSDP steps fp32 main parameters"):
            parse_config([*fsdp, params, value])


def test_flex_dispatcher_is_refused_naming_alltoall():
    with pytest.raises(ValueError, match=r"'flex' needs DeepEP or HybridEP .* use 'alltoall'"):
        parse_config([*MODEL, "--num-experts", "4", "--moe-token-dispatcher-type", "flex"])


def test_distributed_optimizer_instances_and_megatron_fsdps_outer_level():
    """--num-distributed-optimizer-instances needs the distributed optimizer or FSDP (then
    hybrid: replicated across the instances, Megatron-FSDP's --outer-dp-sharding-strategy
    no_shard, which is taken; optim is refused) and not the layer-wise optimizer."""
    run = [*MODEL, "--seq-length", "16", "--max-position-embeddings", "16",
           "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
           "--num-distributed-optimizer-instances", "2"]  # fmt: skip
    zero3 = ["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "no_shard"]
    for flags in (["--use-distributed-optimizer"], zero3):
        config = parse_config([*run, *flags])
        assert config.parallel.num_distributed_optimizer_instances == 2
        assert validate(config, 4)["data_parallel_size"] == 4
    with pytest.raises(ConfigError, match="needs --use-distributed-optimizer, or FSDP"):
        validate(parse_config(run), 4)
    with pytest.raises(ConfigError, match="layer-wise distributed optimizer: not supported"):
        validate(parse_config([*run, "--optimizer", "muon", "--use-distributed-optimizer"]), 4)
    with pytest.raises(ValueError, match="instances=2 must divide the data-parallel x "):
        validate(parse_config([*run, "--use-distributed-optimizer"]), 3)
    with pytest.raises(ValueError, match="--outer-dp-sharding-strategy optim: mp's hybrid"):
        parse_config([*run, "--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"])


HYBRID_SPEC = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]


@pytest.mark.parametrize(
    "spec",
    [["local"], ["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     ["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"]],
)  # fmt: skip
def test_megatrons_own_layer_specs_change_nothing(capsys, spec):
    assert parse_config([*MODEL, "--spec", *spec]) == parse_config(MODEL)
    assert "accepted without effect: --spec" in capsys.readouterr().err


def test_the_hybrid_stack_spec_needs_a_hybrid_pattern_and_another_spec_is_refused(capsys):
    """Megatron-LM's Mamba example passes its hybrid stack spec (examples/mamba/train.sh)."""
    hybrid = [*MODEL, "--hybrid-layer-pattern", "M*", "--mamba-num-heads", "8",
              "--mamba-head-dim", "8"]  # fmt: skip
    assert parse_config([*hybrid, *HYBRID_SPEC]) == parse_config(hybrid)
    unbuilt = r"hybrid_stack_spec: Megatron-LM's hybrid stack builds the layers of --hybrid-"
    with pytest.raises(ValueError, match=unbuilt):
        parse_config([*MODEL, *HYBRID_SPEC], exit_on_error=False)
    custom = r"^--spec my.specs my_layer_spec: a layer spec of its own, code mp does not run"
    with pytest.raises(ValueError, match=custom):
        parse_config([*MODEL, "--spec", "my.specs", "my_layer_spec"], exit_on_error=False)


def test_no_cuda_graph_changes_nothing_and_a_capture_is_refused(capsys):
    """--cuda-graph-impl none (Megatron-LM's default) and the flags tuning a capture change
    nothing; a capture asked for, by --cuda-graph-impl or the deprecated switches, stops the
    run naming it."""
    tuning = ["--cuda-graph-impl", "none", "--cuda-graph-scope", "attn", "mlp",
              "--cuda-graph-modules", "attn", "--cuda-graph-warmup-steps", "3"]  # fmt: skip
    assert parse_config([*MODEL, *tuning]) == parse_config(MODEL)
    assert "--cuda-graph-impl --cuda-graph-modules --cuda-graph-scope" in capsys.readouterr().err
    for capture in (["--cuda-graph-impl", "local"], ["--cuda-graph-impl", "full_iteration"],
                    ["--enable-cuda-graph"], ["--external-cuda-graph"]):  # fmt: skip
        named = " ".join(capture)
        with pytest.raises(ValueError, match=f"^{named}: a CUDA graph capture, which mp does "):
            parse_config([*MODEL, *capture], exit_on_error=False)
