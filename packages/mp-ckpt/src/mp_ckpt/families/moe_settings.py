"""What the mixture-of-experts families share in config.json <-> settings.

Routing. Mixtral, Qwen2-MoE and Qwen3-MoE score the experts with a softmax over all of
them and keep the top k. Renormalizing the k kept probabilities (Mixtral always; the
Qwens with norm_topk_prob=True) equals a softmax over the k largest logits:
moe_router_pre_softmax=False; without it the kept weights are the full softmax's:
moe_router_pre_softmax=True. They train with the Switch load-balancing loss over the
batch (moe_router_load_balancing_type="aux_loss", router_aux_loss_coef ->
moe_aux_loss_coeff). Llama 4 weighs its one expert by a sigmoid instead (the export's
score_function). DeepSeek-V3 and Nemotron 3 score with sigmoids too, normalize the kept
weights of more than one expert (norm_topk_prob), and may limit each token to
topk_group of n_group groups of experts, a group ranked by the sum of its GROUP_RANK
best scores: mp's router (Megatron's rule) ranks by num_experts_per_tok // topk_group of
them, so the two agree where that is GROUP_RANK (`sigmoid_routing`, `check_group_rank`).

Layers. A Qwen-MoE layer i is sparse iff i is not in mlp_only_layers and (i + 1) %
decoder_sparse_step == 0; the others are a dense SwiGLU MLP of intermediate_size. mp
keeps the pattern as moe_layer_freq, a 0/1 list per layer; sparse_step finds the
(decoder_sparse_step, mlp_only_layers) that give it back.
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config

__all__ = ["GROUP_RANK", "aux_loss_coef", "check_group_rank", "check_routing", "moe_config",
           "positive", "routing", "sigmoid_routing", "sparse_layers", "sparse_step"]  # fmt: skip

GROUP_RANK = 2
"""The best scores a group of experts is ranked by (transformers' topk(2) in DeepSeek-V3's
and Nemotron-H's routers)."""


def _get(config: dict, key: str, defaults: dict):
    value = config.get(key)
    return defaults[key] if value is None else value


def positive(config: dict, key: str, defaults: dict) -> int:
    value = _get(config, key, defaults)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def routing(config: dict, experts_key: str, defaults: dict) -> dict:
    experts = positive(config, experts_key, defaults)
    topk = positive(config, "num_experts_per_tok", defaults)
    if topk > experts:
        raise ValueError(
            f"config.json num_experts_per_tok={topk}: more than {experts_key}={experts}"
        )
    return {
        "num_moe_experts": experts, "moe_router_topk": topk,
        "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.001),
        "moe_z_loss_coeff": None,
    }  # fmt: skip


def sparse_layers(config: dict) -> list[int]:
    """moe_layer_freq of a Qwen-MoE config.json (decoder_sparse_step, mlp_only_layers): 1
    for a sparse layer, 0 for a dense one."""
    step = positive(config, "decoder_sparse_step", {"decoder_sparse_step": 1})
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"config.json mlp_only_layers={dense!r}: expected a list of layer indices")
    layers = config["num_hidden_layers"]
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise ValueError(
            f"config.json decoder_sparse_step={step} with mlp_only_layers={dense!r}: none of "
            f"the num_hidden_layers={layers} layers is sparse"
        )
    return pattern


# --- export ------------------------------------------------------------------------------


def check_routing(settings: dict, arch: str, pre_softmax: bool | None,
                  score_function: str = "softmax") -> int:  # fmt: skip
    topk = settings.get("moe_router_topk")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"model_config moe_router_topk={topk!r}: the {arch} export needs it")
    # transformers' experts take every routed token (no capacity) and route on the scores
    # alone (no expert bias)
    checks = [
        ("moe_router_score_function", score_function),
        ("moe_router_topk_scaling_factor", None),
        ("moe_expert_capacity_factor", None),
        ("moe_router_enable_expert_bias", False),
    ]
    if pre_softmax is not None:
        checks.append(("moe_router_pre_softmax", pre_softmax))
    for field, supported in checks:
        value = settings.get(field, supported)
        if value != supported and not (field == "moe_router_topk_scaling_factor" and value == 1.0):
            raise ValueError(
                f"model_config {field}={value!r}: {arch} computes only {field}={supported!r}"
            )
    return topk


def aux_loss_coef(settings: dict) -> float:
    """config.json's router_aux_loss_coef: the Switch-style load-balancing loss's weight."""
    kind = settings.get("moe_router_load_balancing_type", "aux_loss")
    coeff = settings.get("moe_aux_loss_coeff", 0.0)
    if isinstance(kind, list):  # several losses: the Switch-style one's, which the model has
        return dict(zip(kind, coeff, strict=True)).get("aux_loss", 0.0)
    return 0.0 if kind == "none" else coeff


def sparse_step(sparse: list[int]) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) giving exactly the sparse layers `sparse`:
    the step that leaves the fewest layers to list (then the smallest step)."""
    best = None
    for step in range(1, len(sparse) + 1):
        by_step = [(i + 1) % step == 0 for i in range(len(sparse))]
        if any(s and not b for s, b in zip(sparse, by_step, strict=True)):
            continue  # a sparse layer this step would make dense
        dense = [i for i, (s, b) in enumerate(zip(sparse, by_step, strict=True)) if b and not s]
        if best is None or len(dense) < len(best[1]):
            best = (step, dense)
    assert best is not None  # step 1 marks every layer sparse
    return best


def moe_config(settings: dict, shapes: dict, tokens: dict, dtype: str, arch: str,
               pre_softmax: bool | None, score_function: str = "softmax",
               **computes) -> dict:  # fmt: skip
    """base_config's keys without the dense width, and the routing's keys (the router's
    scores: score_function's)."""
    config = base_config(settings, shapes | {"ffn": None}, tokens, dtype, arch, **computes)
    del config["intermediate_size"]
    return config | {
        "use_cache": True, "output_router_logits": False,
        "router_aux_loss_coef": aux_loss_coef(settings),
        "num_experts_per_tok": check_routing(settings, arch, pre_softmax, score_function),
    }  # fmt: skip


def sigmoid_routing(config: dict, experts: int, topk: int, defaults: dict, arch: str) -> dict:
    """The group limits of DeepSeek-V3-style sigmoid routing (module docstring), after
    checking norm_topk_prob (absent: true) against what mp's router does."""
    norm = config.get("norm_topk_prob")
    norm = True if norm is None else norm
    if norm is not (topk > 1):
        raise ValueError(
            f"config.json norm_topk_prob={norm!r} with num_experts_per_tok={topk}: mp's sigmoid "
            "router normalizes the weights of more than one expert and leaves one expert's "
            f"alone (norm_topk_prob={topk > 1})"
        )
    groups, kept = positive(config, "n_group", defaults), positive(config, "topk_group", defaults)
    if experts % groups:
        raise ValueError(f"config.json n_group={groups} does not divide n_routed_experts={experts}")
    if kept >= groups:
        return {"moe_router_num_groups": None, "moe_router_group_topk": None}
    if topk // kept != GROUP_RANK:
        raise ValueError(
            f"config.json num_experts_per_tok={topk} with topk_group={kept}: {arch} ranks a "
            f"group by its {GROUP_RANK} best scores, mp's router by its num_experts_per_tok "
            f"// topk_group = {topk // kept} best (Megatron's rule)"
        )
    return {"moe_router_num_groups": groups, "moe_router_group_topk": kept}


def check_group_rank(settings: dict, arch: str) -> tuple[int, int]:
    """(n_group, topk_group) of the settings' group limits (1, 1 without), refusing those
    whose groups mp's router ranks otherwise than `arch` (module docstring)."""
    topk = settings["moe_router_topk"]
    groups = settings.get("moe_router_num_groups") or 1
    kept = settings.get("moe_router_group_topk") or groups
    if kept < groups and topk // kept != GROUP_RANK:
        raise ValueError(
            f"model_config moe_router_topk={topk} with moe_router_group_topk={kept}: {arch} "
            f"ranks a group by its {GROUP_RANK} best scores"
        )
    return groups, kept
