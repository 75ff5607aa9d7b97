"""GPT pretraining, run with torchrun (Megatron's pretrain_gpt.py):

torchrun --nproc-per-node 2 apps/gpt/pretrain_gpt.py --config apps/gpt/configs/tiny.yaml
"""

import sys

from mp_gpt.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
