"""What a run reports: the log lines and metrics file (metrics), TensorBoard and W&B
(tensorboard), timers (timers), the slowest ranks (stragglers), torch.profiler traces
(profiling) and Python logging (log_setup)."""
