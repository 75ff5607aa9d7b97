"""How FullyShardedDataParallel shards modules: torch's FSDP2 `fully_shard` over meshes
made from mp's own groups, with mp's mixed precision, its parameters' attributes kept,
and on the CPU a reduce-scatter gloo runs faster.

    sharding = FsdpSharding(config, dp_group, expert_dp_group)
    with mp_layers.on_layer_built(sharding.shard):   # optional: each layer as built
        chunk = GPTModel(...)
    model = FullyShardedDataParallel(config, chunk, ..., sharding=sharding)

A module holding only routed experts' parameters is sharded over expert dp, the rest
over dp; fully_shard runs bottom-up (the expert modules inside a unit before the unit,
the units before the chunk). With distributed-optimizer instances (`InstanceGroups`,
Megatron-FSDP's hybrid sharding with an unsharded outer level) the mesh is 2-D, the
instances by the rank's slice: FSDP2's HSDP shards over the slice and all-reduces the
reduced shards across the slices.
"""

from __future__ import annotations

import torch

from mp_optim.config import OptimizerConfig
from mp_optim.ddp import InstanceGroups, is_expert_parallel
from mp_state import RankGroup, select_device

__all__ = ["FsdpSharding", "is_dtensor", "is_sharded"]


class FsdpSharding:
    """How modules are sharded for FullyShardedDataParallel: FSDP2's `fully_shard` over
    meshes made from `dp_group` (and `expert_dp_group` for modules holding only routed
    experts' parameters), with the mixed-precision policy of `config`.

    `shard(layer)` may run while the chunk is still being built (as
    `mp_layers.on_layer_built`'s callback), so that each layer is sharded before the
    next one exists; the wrapper then shards the rest."""

    def __init__(
        self, config: OptimizerConfig, dp_group: RankGroup,
        expert_dp_group: RankGroup | None = None, instances: InstanceGroups | None = None,
        expert_instances: InstanceGroups | None = None,
    ) -> None:  # fmt: skip
        if not config.fully_sharded:
            raise ValueError(
                "FullyShardedDataParallel needs a fully sharded config (use_megatron_fsdp with "
                "data_parallel_sharding_strategy optim_grads or optim_grads_params, or "
                "use_torch_fsdp2)"
            )
        _check_torch()
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.config = config
        self.expert_dp_group = expert_dp_group
        compute = config.model_dtype
        self.policy = MixedPrecisionPolicy(
            param_dtype=None if compute == torch.float32 else compute,
            reduce_dtype=torch.float32 if config.grad_reduce_in_fp32 else compute,
            cast_forward_inputs=False,  # mp's layers cast what they need, as under DDP
        )
        self.device_type = select_device().device.type
        self.instances = instances
        self.expert_instances = expert_instances
        self.dense_mesh = _mesh(dp_group, self.device_type, instances)
        self._expert_mesh = None
        # (id of the owning module, parameter name) -> the attributes to keep
        self._attributes: dict[tuple[int, str], dict] = {}

    def shard(self, module: torch.nn.Module, *, root: bool = False) -> None:
        """Shards `module`: first its modules holding only expert parameters (over expert
        dp), then the rest of its parameters not sharded yet (over dp). A `root` (the
        chunk) keeps its own parameters (embeddings, output layer) gathered from its
        forward to its backward, which needs them first (FSDP2's default for a root)."""
        for unit in _expert_units(module):
            if self.expert_dp_group is None:
                name = next(n for n, p in module.named_parameters() if is_expert_parallel(p))
                raise ValueError(
                    f"{name} is an expert-parallel parameter (expert_parallel=True), but "
                    "FullyShardedDataParallel got no expert_dp_group to shard it over: pass "
                    "expert_dp_group=state.expert_dp"
                )
            if self._expert_mesh is None:
                self._expert_mesh = _mesh(
                    self.expert_dp_group, self.device_type, self.expert_instances
                )
            self._fully_shard(unit, self._expert_mesh, self.config.reshard_after_forward)
        reshard = self.config.reshard_after_forward
        if root:
            reshard = None if reshard else False
        self._fully_shard(module, self.dense_mesh, reshard)

    def _fully_shard(self, module: torch.nn.Module, mesh, reshard: bool | None) -> None:
        """fully_shard, keeping what it loses: the parameters' Python attributes (mp's
        sequence_parallel, shared_embedding, expert_parallel, ...) and their dtype, as
        `unsharded_dtype` (the shards are fp32: the main parameters)."""
        from torch.distributed.fsdp import fully_shard

        kept: dict[int, dict] = {}  # a tied parameter has two owners
        recipes: dict[tuple[int, str], object] = {}  # weights left on meta, to draw
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                if not is_dtensor(param):
                    if id(param) not in kept:
                        attributes = {k: v for k, v in vars(param).items() if k != _RECIPE}
                        kept[id(param)] = {**attributes, "unsharded_dtype": param.dtype}
                    self._attributes[id(owner), name] = kept[id(param)]
                    if hasattr(param, _RECIPE):
                        recipes[id(owner), name] = getattr(param, _RECIPE)
        for param in module.parameters():
            if id(param) in kept and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=self.policy)
        if self.device_type == "cpu" and hasattr(module, "set_custom_reduce_scatter"):
            custom = _reduce_scatter_by_all_reduce()
            if custom is not None:
                module.set_custom_reduce_scatter(custom)
        self.restore_attributes(module)
        if recipes:
            _draw_shards(module, recipes, self.restore_attributes)

    def restore_attributes(self, module: torch.nn.Module) -> None:
        """Puts the attributes kept at sharding back on `module`'s sharded parameters
        (FSDP2 drops them again when a sharded module is moved with `.to()`)."""
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                for key, value in self._attributes.get((id(owner), name), {}).items():
                    setattr(param, key, value)


_RECIPE = "_mp_deferred_init"
"""The attribute of a weight mp_layers left on the meta device: its recipe."""


def _draw_shards(module: torch.nn.Module, recipes: dict, restore) -> None:
    """Gives `module`'s sharded parameters still on the meta device their memory (this
    rank's rows only) and draws their values from their recipes, as the whole weights
    would have been drawn, rounded to the model's dtype, then sharded. A recipe (mp_layers'
    DeferredInit) has fill_rows(start, stop, out, through): rows [start, stop) of the
    unsharded parameter into `out`, rounded to the dtype `through` on the way. `restore`
    puts the kept attributes back on the new parameters."""
    device = select_device().device
    replaced: dict[int, torch.nn.Parameter] = {}  # a tied weight has two owners, one shard
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.is_meta and (id(owner), name) not in recipes:
                raise RuntimeError(
                    f"{type(owner).__name__}.{name} is on the meta device without a recipe "
                    f"({_RECIPE}) to draw its shard from"
                )
            if param.is_meta:
                if id(param) not in replaced:
                    empty = torch.empty_like(param, device=device)  # this rank's shard
                    replaced[id(param)] = torch.nn.Parameter(empty, param.requires_grad)
                setattr(owner, name, replaced[id(param)])
    _repad_shards(module)
    restore(module)
    filled = set()
    with torch.no_grad():
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                recipe = recipes.get((id(owner), name))
                if recipe is None or id(param) in filled:
                    continue
                filled.add(id(param))
                local = param.to_local()  # under no_grad: the shard itself
                ranks, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
                rows = param.shape[0]
                start = min(rank * -(-rows // ranks), rows)  # FSDP2's chunks along dim 0
                through = getattr(param, "unsharded_dtype", None)
                through = through if through not in (None, local.dtype) else None
                staged = local if local.device.type == "cpu" else torch.empty(local.shape)
                recipe.fill_rows(start, start + local.shape[0], staged, through)
                if staged is not local:
                    local.copy_(staged)
    stray = [n for n, p in module.named_parameters() if p.is_meta]
    if stray:
        raise RuntimeError(f"{stray[0]} is still on the meta device after sharding")


def _repad_shards(module: torch.nn.Module) -> None:
    """FSDP2 keeps each shard in padded storage of its own: after a sharded parameter is
    replaced it points its storage at the new one, as Module._apply's override does
    (which would also swap every other parameter in place)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before 2.12: one group per fully_shard call
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    with torch.no_grad():
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()


def _reduce_scatter_by_all_reduce():
    """FSDP2's reduce-scatter done as an all-reduce of the whole input and a copy of this
    rank's part: on the CPU gloo's reduce-scatter of a tensor takes 1.6 to 3 times its
    all-reduce (ci/bench/bench_fsdp.py), and the all-reduce carries no more data."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # a torch whose FSDP2 keeps the interface elsewhere: gloo's own
        return None

    class AllReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            averaged = op == dist.ReduceOp.AVG
            dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM if averaged else op, group=group)
            mine = input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
            output_tensor.copy_(mine)
            if averaged:
                output_tensor.div_(dist.get_world_size(group))
            return None

    return AllReduceScatter()


_FSDP2_CALLS = (
    "set_requires_gradient_sync",
    "set_is_last_backward",
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_modules_to_forward_prefetch",
)


def _check_torch() -> None:
    """This torch's FSDP2 has what the wrapper calls (torch 2.15 and 2.11 are tested)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
    missing = [c for c in _FSDP2_CALLS if not hasattr(FSDPModule, c)]
    if missing:
        raise RuntimeError(
            f"FullyShardedDataParallel needs torch's FSDP2 with {', '.join(missing)}, which "
            f"torch {torch.__version__} lacks: upgrade torch (2.11 and 2.15 are tested)"
        )


def _mesh(group: RankGroup, device_type: str, instances: InstanceGroups | None = None):
    """The 1-D DeviceMesh over one of mp's groups, its dimension named after the process
    group (e.g. "dp_cp 6"); with `instances`, the 2-D mesh [instance, rank in the slice]
    of the group's ranks over their inter and intra groups (FSDP2 replicates over the
    first dimension, shards over the second). A DeviceMesh equals another over the same
    ranks with the same names, whatever its process group, and DTensor's caches answer by
    that equality: after mp_state's groups were destroyed and made again (a second run in
    one process), a sharded parameter was handed the earlier run's mesh, whose group no
    longer exists."""
    from torch.distributed.device_mesh import DeviceMesh

    if instances is None:
        name = f"{group.kind} {group.group.group_name}"
        return DeviceMesh.from_group(group.group, device_type, mesh_dim_names=(name,))
    inter, intra = instances.inter, instances.intra
    ranks = torch.tensor(group.ranks, dtype=torch.int).view(inter.size, intra.size)
    names = tuple(f"{g.kind} {g.group.group_name}" for g in (inter, intra))
    return DeviceMesh.from_group([inter.group, intra.group], device_type, mesh=ranks,
                                 mesh_dim_names=names)  # fmt: skip


def _expert_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules not sharded yet whose parameters are all expert-parallel (a
    MoE layer's experts), in module order."""
    found = []

    def visit(name: str, sub: torch.nn.Module) -> None:
        if is_sharded(sub):
            return
        params = list(sub.parameters())
        if params and all(is_expert_parallel(p) for p in params):
            if sub is module:
                raise ValueError("every parameter of the chunk is expert-parallel: nothing "
                                 "to shard over dp_group")  # fmt: skip
            found.append(sub)
            return
        for pname, param in sub.named_parameters(recurse=False):
            if is_expert_parallel(param):
                raise ValueError(
                    f"{name}.{pname} is an expert-parallel parameter beside dense ones in "
                    "one module: FSDP shards the two kinds over different groups, so expert "
                    "parameters need modules of their own"
                )
        for child_name, child in sub.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return found


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_dtensor(param) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)
