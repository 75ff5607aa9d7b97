"""Megatron-LM training checkpoints (torch_dist and legacy torch) <-> mp: read.py and
write.py handle the formats, logical.py and settings.py the names and args, optimizer.py
and distopt.py the Adam state."""
