"""Child of test_comm_health: all-reduces in a loop until the test kills one rank.

Launched like torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); prints 'ready' once.
"""

import sys

import torch

import memrt.comm as dist

dist.init_process_group("gloo")
t = torch.ones(1 << 20)
dist.all_reduce(t)
print("ready", flush=True)
for _ in range(100000):
    dist.all_reduce(t)
    t.fill_(1.0)
print("finished without noticing the dead rank", flush=True)
sys.exit(3)
