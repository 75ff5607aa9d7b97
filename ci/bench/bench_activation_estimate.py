"""Measure: the activation memory `mp_train.estimate` prints against the measured growth of
one training step, at several sequence lengths, on one rank and at context parallelism 2.

The model is apps/gpt's tiny config (4 layers, hidden 128, 4 heads in 2 groups, SwiGLU,
RoPE, fp32, dropout 0), micro-batch 1, NullTokenizer with 1000 ids (padded to 1024).
Each (sequence, cp) runs in fresh forked ranks (mp_state.testing.run_on_ranks), one
thread each: the GPTModel is built, the resident set read (/proc/self/statm), one
forward and backward of the per-token loss run, and the process's peak resident set
(ru_maxrss) read. `measured_growth_mib` is the peak minus the starting resident set, on
CP rank 0: what the step allocates (activations, their gradients, the logits, the
parameters' gradients, communication buffers). `estimate_activation_mib` is what the run
would print at start (device cpu). The estimate counts what a layer keeps for backward,
not the transient peaks of backward, so the two differ by a factor; the point is that
the factor stays put as the sequence grows and as CP halves each rank's tokens.

    uv run python ci/bench/bench_activation_estimate.py [--seqs 1024,2048,4096,8192,16384]
"""

from __future__ import annotations

import argparse
import os

from harness import context, emit

from mp_state.testing import run_on_ranks

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "apps", "gpt", "configs", "tiny.yaml")


def one_step(seq: int, cp: int) -> dict[str, float]:
    import resource

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    import mp_state
    from mp_layers import GPTModel, ModelGroups, shard_sequence
    from mp_train import estimate, parse_config

    config = parse_config([
        "--config", CONFIG, "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--seq-length", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", "1", "--context-parallel-size", str(cp), "--train-iters", "1",
    ])  # fmt: skip
    estimated = estimate(config, cp, vocab_size=1000, device_type="cpu")["activation_mb"]
    state = mp_state.initialize(config.parallel)
    model = GPTModel(config.model, "local", 1024, seq, groups=ModelGroups.of(state), init_seed=1)
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(0))
    local = shard_sequence(ids, cp, state.cp.rank, dim=1)
    with open(f"/proc/{os.getpid()}/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    model(local, labels=local).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mp_state.destroy()
    return {"estimate_activation_mib": estimated, "measured_growth_mib": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    args = parser.parse_args()
    ctx = context()
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (1, 2):
            figures = run_on_ranks(one_step, cp, seq, cp, timeout=600)[0]
            ratio = figures["measured_growth_mib"] / figures["estimate_activation_mib"]
            emit("activation_estimate", {
                "seq": seq, "cp": cp,
                **{k: round(v, 1) for k, v in figures.items()},
                "measured_over_estimate": round(ratio, 2),
            }, ctx)  # fmt: skip


if __name__ == "__main__":
    main()
