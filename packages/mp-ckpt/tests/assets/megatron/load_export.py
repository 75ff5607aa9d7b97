"""Loads an `mp-ckpt export-megatron` checkpoint with megatron-core's load_checkpoint into
a GPTModel of the fixture's shape (fresh init, another seed), computes the logits on the
fixture's reference tokens and compares them with the fixture's reference logits.

    /tmp/mcore-data-venv/bin/python packages/mp-ckpt/tests/assets/megatron/load_export.py \
        FIXTURE_CASE EXPORTED_DIR FORMAT TP PP [EP]

(EP > 1: the run has EP data-parallel ranks per TP x PP, EP x TP x PP in all.)

Needs megatron-core 0.19.2 (as generate.py); the tests never run it.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as g

FIXTURES = g.HERE


def worker(rank, world, port, case, exported, fmt, tp, pp, ep):
    import logging

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if "--hybrid-layer-pattern" in g.CASES[case].model:
        from hybrid import install_mamba_standins

        install_mamba_standins()  # before megatron-core imports mamba_ssm
    if {"--experimental-attention-variant", "--linear-num-key-heads"} & set(g.CASES[case].model):
        from gdn import install_fla_standins

        install_fla_standins()  # before megatron-core imports FLA
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import patches
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    layout = g.CASES[case]._replace(fmt=fmt, tp=tp, pp=pp, dist_opt=False, dp=ep, ep=ep)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    patches.patch_all()
    tensor_parallel.model_parallel_cuda_manual_seed(g.SEED)
    args = g.megatron_args(exported, layout)
    args.load = exported
    args.no_load_optim = True
    args.no_load_rng = True
    from megatron.training.checkpointing import load_checkpoint

    with patches.cuda_as_cpu():  # tied embeddings under PP: Megatron moves them with .cuda()
        model, optimizer, scheduler = g.build(args, g.SEED + 99)
    ref = torch.load(os.path.join(FIXTURES, case, "reference.pt"), weights_only=True)
    mask = torch.triu(torch.ones(g.SEQ, g.SEQ, dtype=torch.bool), diagonal=1)[None, None]
    data = (ref["tokens"], ref["position_ids"], mask, ref["labels"])
    before, _ = g.full_logits(model, data)
    with patches.cuda_as_cpu(), torch.no_grad():
        iteration, _ = load_checkpoint([model], optimizer, scheduler)
    logits, _ = g.full_logits(model, data)
    # the multi-token prediction modules' losses (the logits do not depend on them; PP1)
    mtp = "mtp_losses" in ref and pp == 1
    d_mtp = (g.mtp_losses_of(model, data) - ref["mtp_losses"]).abs().max().item() if mtp else 0
    if logits is not None:
        d = (logits - ref["logits"]).abs().max().item()
        d0 = (before - ref["logits"]).abs().max().item()
        print(
            f"[{case} -> {fmt} TP{tp} PP{pp} EP{ep}] load_checkpoint iteration {iteration}: "
            f"max|logits - reference| = {d} (before loading: {d0:.3f})"
            + (f", max|MTP losses - reference| = {d_mtp}" if mtp else ""),
            flush=True,
        )
        # bit-exact where the layout is the fixture's own; another TP sums in another order
        same = (g.CASES[case].tp, g.CASES[case].pp) == (tp, pp)
        assert (d, d_mtp) == (0.0, 0.0) if same else max(d, d_mtp) < 1e-6, (d, d_mtp)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    case, exported, fmt = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
    tp, pp = int(sys.argv[4]), int(sys.argv[5])
    ep = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    world = tp * pp * ep
    os.environ["WORLD_SIZE"] = str(world)
    mp.spawn(worker, args=(world, g.free_port(), case, exported, fmt, tp, pp, ep), nprocs=world)
