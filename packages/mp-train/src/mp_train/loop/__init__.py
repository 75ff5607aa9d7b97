"""The training loop: what a run builds before its first iteration (setup), pretrain
(training), evaluate on the validation and test splits (evaluation), the per-step parts
for MoE and multi-token prediction (moe_step, mtp_step), micro-batches per iteration
(microbatches), checkpoints (checkpointing), and the exit on a signal, a time limit or a
hang (signals, cadence, process_clock, hang_watchdog)."""
