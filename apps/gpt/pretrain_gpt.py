"""GPT pretraining, run with torchrun (Megatron's pretrain_gpt.py):

torchrun --nproc-per-node 2 apps/gpt/pretrain_gpt.py --config apps/gpt/configs/tiny.yaml
"""

import sys

if __name__ == "__main__":
    from mp_gpt import program

    program.imports_begin()  # as `python -m mp_gpt.pretrain` starts: mp_gpt.program says why
    from mp_gpt.pretrain import main

    sys.exit(program.run(main))
