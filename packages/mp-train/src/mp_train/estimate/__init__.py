"""`mp-train estimate`: theoretical memory and FLOPs of a configuration, without a process.
mp's own count (memory_flops, its parameters in parameters) or Megatron-LM's
(megatron_formula)."""

from mp_train.estimate.memory_flops import estimate, main, padded_vocab_size

__all__ = ["estimate", "main", "padded_vocab_size"]
