"""GPT pretraining, run with torchrun (Megatron's pretrain_gpt.py):

torchrun --nproc-per-node 2 apps/gpt/pretrain_gpt.py --config apps/gpt/configs/tiny.yaml
"""

import gc
import sys

if __name__ == "__main__":
    # No cyclic collection while mp and torch are imported (as `python -m mp_gpt.pretrain`
    # does, there): their objects live as long as the process.
    gc.disable()
    from mp_gpt.pretrain import main

    gc.enable()
    sys.exit(main())
