"""The training loop: what a run builds before its first iteration (setup), pretrain and
evaluate (training), the per-step parts for MoE and multi-token prediction (moe_step,
mtp_step), micro-batches per iteration (microbatches), checkpoints (checkpointing), and
the exit on a signal or a hang (signals, hang_watchdog)."""
