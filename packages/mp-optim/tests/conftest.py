"""Warms once, in the pytest process, what forked ranks would otherwise each import.

A torch optimizer's first step imports torch's compiler machinery (about 4 s
here); four forked ranks doing it at once on two cores took 8 s per test.
"""

import torch

_param = torch.nn.Parameter(torch.ones(1))
_param.grad = torch.ones(1)
torch.optim.AdamW([_param]).step()
torch.testing.assert_close(torch.ones(1), torch.ones(1))
