"""One forward and backward of a fixture case's model in megatron-core, its gradients
after `finalize_model_grads` gathered whole (TP1 layout) into a file, for comparing two
layouts of the same model from the same weights and batch:

    /tmp/mcore-data-venv/bin/python packages/mp-ckpt/tests/assets/megatron/grad_probe.py \
        CASE OUT.pt TP

TP 1 drops the case's --sequence-parallel. Each gradient is saved under the parameter's
model-global name, and `<name>#sp` records whether megatron-core marks it
sequence_parallel. Needs megatron-core 0.19.2, as generate.py; the tests never run it.
(It showed that megatron-core's gradients of the MLA model at TP2 with sequence
parallelism differ from its TP1 ones: README.md, "Hybrid checkpoints".)
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as g
from record import global_name, tp_gather


def worker(rank, world, port, name, out):
    import logging

    import torch

    if world == 1:  # the case at TP1, without sequence parallelism
        case = g.CASES[name]
        extra = tuple(a for a in case.extra if a != "--sequence-parallel")
        g.CASES[name] = case._replace(tp=1, dp=1, dist_opt=False, extra=extra)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import patches
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    case = g.CASES[name]
    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp)
    patches.patch_all()
    tensor_parallel.model_parallel_cuda_manual_seed(g.SEED)
    args = g.megatron_args(name, case)
    model, _, _ = g.build(args, g.SEED)
    tokens, position_ids, mask, labels = g.batch(args, seed=0)

    def forward_step(data_iterator, module):
        output = module(tokens, position_ids, mask, labels=labels)
        return output, lambda per_token: (per_token.float().mean(), {})

    model.zero_grad_buffer()
    with patches.cuda_as_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
            num_microbatches=1, seq_length=g.SEQ, micro_batch_size=g.MICRO_BATCH,
            forward_only=False,
        )  # fmt: skip
        finalize_model_grads([model])
    grads = {}
    for n, p in model.module.named_parameters():
        grads[global_name(n)] = tp_gather(p.main_grad, p, n)
        grads[global_name(n) + "#sp"] = bool(getattr(p, "sequence_parallel", False))
    if rank == 0:
        torch.save(grads, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    name, out, tp = sys.argv[1], os.path.abspath(sys.argv[2]), int(sys.argv[3])
    os.chdir(g.HERE)
    os.environ["WORLD_SIZE"] = str(tp)
    mp.spawn(worker, args=(tp, g.free_port(), name, out), nprocs=tp, join=True)
