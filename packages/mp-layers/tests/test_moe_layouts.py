"""A MoE GPTModel at every expert layout gives one process's losses and gradients.

Four ranks; the global batch is four sequences, each data-parallel rank taking its
micro-batch of them. One process runs the same micro-batches one after the other, each
loss divided by their number (and the auxiliary losses scaled alike), as a training step
does. The parallel run reduces gradients as a training step does: sequence-parallel
weights summed over tp, dense gradients averaged over dp, experts' summed over
expert_dp and divided by dp (they already hold every rank's tokens' contributions).
Top-2 routing, load-balancing and z-losses on, a gated shared expert, fp32. The gpt-oss
layouts have its MLP instead: the clamped quick GEGLU and biases everywhere (router, experts'
fc1 and fc2, attention), no shared expert; every bias is set away from 0 first, so that an
fc2 bias added more than once over expert-TP, or to a padded copy, would show."""

import zlib

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, assemble
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_layers.moe import AuxLossScale, is_expert_key, share_aux_loss_scale
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH, WORLD = 128, 16, 4, 4
MODEL = dict(
    num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=8,
    position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
    ffn_hidden_size=96, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=4, moe_ffn_hidden_size=48,
    moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
)  # fmt: skip
# (tensor parallel with sequence parallelism, expert parallel, expert tensor parallel,
#  and settings of the MoE layer)
LAYOUTS = {
    "EP2": (1, 2, 1, dict(moe_token_dispatcher_type="alltoall")),
    "EP2xTP2": (2, 2, 1, dict(moe_token_dispatcher_type="alltoall")),
    "EP2xTP2xETP2": (2, 2, 2, dict(moe_token_dispatcher_type="alltoall")),
    "EP4": (1, 4, 1, dict(moe_token_dispatcher_type="alltoall", moe_layer_freq=[0, 1])),
    "EP2-allgather": (1, 2, 1, dict(moe_token_dispatcher_type="allgather")),
    "EP2xTP2xETP2-allgather": (2, 2, 2, dict(moe_token_dispatcher_type="allgather")),
    "EP2-capacity": (1, 2, 1, dict(moe_token_dispatcher_type="alltoall",
                                   moe_expert_capacity_factor=1.0, moe_grouped_gemm=True)),
    # Group-limited as device-limited routing: 2 groups of 2 experts, one per EP rank, and
    # each token's experts in one of them.
    "EP2-sigmoid-seq-aux-groups": (1, 2, 1, dict(
        moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="seq_aux_loss", moe_router_topk_scaling_factor=2.0,
        moe_router_num_groups=2, moe_router_group_topk=1)),
}  # fmt: skip
GPT_OSS = dict(activation="gelu", quick_geglu=True, glu_linear_offset=1.0,
               activation_func_clamp_value=7.0, add_bias_linear=True,
               moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)  # fmt: skip
LAYOUTS |= {
    "gpt-oss-EP2": (1, 2, 1, GPT_OSS | dict(moe_token_dispatcher_type="alltoall")),
    "gpt-oss-EP2xTP2xETP2": (2, 2, 2, GPT_OSS | dict(moe_token_dispatcher_type="alltoall")),
    "gpt-oss-EP2xTP2xETP2-allgather": (2, 2, 2, GPT_OSS | dict(
        moe_token_dispatcher_type="allgather")),
    "gpt-oss-EP2-padded": (1, 2, 1, GPT_OSS | dict(
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True)),
}  # fmt: skip


def set_biases(model: GPTModel) -> None:
    """Every bias to values drawn from its logical name, whatever the layout (small
    enough that the router still sends every expert tokens)."""
    with torch.no_grad():
        for key, piece in model.sharded_state_dict().items():
            if key.endswith("bias"):
                generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                whole = torch.randn(piece.global_shape, generator=generator) * 0.01
                piece.data.copy_(whole[piece.global_slices])


def batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=generator)


def config_of(settings: dict, tp: int) -> TransformerConfig:
    return TransformerConfig(**MODEL | settings, sequence_parallel=tp > 1)


def grad_pieces(model: GPTModel, state: mp_state.ParallelState) -> list[ShardedTensor]:
    """The sharding description over the gradients, pieces of data-parallel ranks > 0 marked
    as replicas (a checkpoint's rule: expert_dp for the experts, dp for the rest)."""
    params = list(model.parameters())
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        pieces = []
        for k, v in model.sharded_state_dict().items():
            dp = state.expert_dp if is_expert_key(k) else state.dp
            replica = v.replica_id * dp.size + dp.rank
            pieces.append(
                ShardedTensor(k, v.data.clone(), v.global_shape, v.global_offset, replica)
            )
        return pieces
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def on_rank(name: str):
    torch.set_num_threads(1)
    tp, ep, etp, settings = LAYOUTS[name]
    state = mp_state.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                       expert_tensor_parallel_size=etp)
    )  # fmt: skip
    model = GPTModel(config_of(settings, tp), "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                     init_seed=11)  # fmt: skip
    set_biases(model)
    ids, labels = (t.chunk(state.dp.size)[state.dp.rank] for t in batch())
    loss = model(ids, labels=labels)
    loss.mean().backward()
    all_reduce_sequence_parallel_grads(model, state.tp)
    for param in model.parameters():
        group = state.expert_dp if getattr(param, "expert_parallel", False) else state.dp
        if group.size > 1:
            dist.all_reduce(param.grad, group=group.group)
        param.grad /= state.dp.size
    return state.dp.rank, loss.detach(), grad_pieces(model, state)


def one_process(name: str, micro_batches: int):
    config = config_of(LAYOUTS[name][3], 1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=11)
    set_biases(model)
    share_aux_loss_scale([model], AuxLossScale("moe", 1.0 / micro_batches))
    losses = []
    for ids, labels in zip(*(t.chunk(micro_batches) for t in batch()), strict=True):
        loss = model(ids, labels=labels)
        (loss.mean() / micro_batches).backward()
        losses.append(loss.detach())
    return losses, _grads(model)


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    params = list(model.parameters())
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return {k: v.data.clone() for k, v in model.sharded_state_dict().items()}
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_expert_layout_gives_one_process_losses_and_gradients(name):
    tp = LAYOUTS[name][0]
    reference_losses, reference = one_process(name, WORLD // tp)
    per_rank = run_on_ranks(on_rank, WORLD, name, timeout=180)
    for dp_rank, loss, _ in per_rank:
        torch.testing.assert_close(loss, reference_losses[dp_rank], rtol=1e-5, atol=1e-6)
    grads = assemble([p for _, _, pieces in per_rank for p in pieces])
    assert grads.keys() == reference.keys()
    for key, want in reference.items():
        torch.testing.assert_close(
            grads[key], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k} at {name}: {m}"
        )
    expert_grad = reference["decoder.layers.1.mlp.experts.linear_fc2.weight"]
    assert (expert_grad.flatten(1).abs().sum(1) > 0).all(), "every expert gets tokens"


NO_SP = {  # (tp, ep, etp, settings): a MoE model at TP2 without sequence parallelism
    "EP2xTP2": LAYOUTS["EP2xTP2"],
    "EP2xTP2xETP2-allgather": LAYOUTS["EP2xTP2xETP2-allgather"],
    "gpt-oss-EP2xTP2xETP2": LAYOUTS["gpt-oss-EP2xTP2xETP2"],
    # DeepSeek's group-limited routing, which takes no empty batch of tokens
    "EP2xTP2-sigmoid-seq-aux-groups": (2, 2, 1, LAYOUTS["EP2-sigmoid-seq-aux-groups"][3]),
}


def logits_without_sequence_parallelism(name: str, lengths: list[int]):
    """This rank's full-vocabulary logits, in eval mode, of one sequence of each length;
    then whether a training step was refused."""
    torch.set_num_threads(1)
    tp, ep, etp, settings = NO_SP[name]
    state = mp_state.initialize(ParallelConfig(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    ))  # fmt: skip
    config = TransformerConfig(**MODEL | settings, sequence_parallel=False)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), init_seed=11,
                     parallel_output=False)  # fmt: skip
    set_biases(model)
    return _eval_logits(model, lengths), _training_refused(model)


def _eval_logits(model: GPTModel, lengths: list[int]) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return [model(batch()[0][:1, :n]) for n in lengths]


def _training_refused(model: GPTModel) -> bool:
    model.train()
    try:
        model(batch()[0][:1, :4]).sum().backward()
    except RuntimeError as error:
        return "trains only with sequence_parallel=True" in str(error)
    return False


@pytest.mark.parametrize("name", list(NO_SP))
def test_without_sequence_parallelism_each_tensor_parallel_rank_routes_a_share(name):
    """Generation runs without sequence parallelism: at TP2 every rank holds all tokens
    and routes ceil(T / 2) of them, the last rank fewer (T = 3), or none (T = 1, a decode
    step of one sequence: a zero row routed nowhere); the logits are one process's. A
    training step is refused."""
    lengths = [1, 3, SEQ]
    model = GPTModel(TransformerConfig(**MODEL | NO_SP[name][3]), "local", VOCAB, SEQ,
                     groups=ModelGroups.single(), init_seed=11)  # fmt: skip
    set_biases(model)
    want = _eval_logits(model, lengths)
    for got, refused in run_on_ranks(logits_without_sequence_parallelism, WORLD, name, lengths,
                                     timeout=180):  # fmt: skip
        assert refused
        for length, a, b in zip(lengths, got, want, strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=length: f"T={n}: {m}"
            )
