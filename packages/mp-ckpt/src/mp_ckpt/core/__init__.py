"""mp-ckpt's core: sharding descriptions, planning and reading pieces, the checkpointer
(atomic commit, async save), integrity checks, offline resharding. mp-layers and
mp-optim use this part; the conversion part (hf, megatron, families) imports it, never
the other way round."""
