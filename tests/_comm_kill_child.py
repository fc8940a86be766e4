"""Child of test_comm_health: all-reduces in a loop until the test kills or stops one rank.

Launched like torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); prints 'ready' once.
``--async``: each all-reduce is launched with ``async_op=True`` and waited on through its future (the
path DDP's comm hook takes), instead of a blocking call.
"""

import sys

import torch

import memrt.comm as dist

use_future = "--async" in sys.argv
dist.init_process_group("gloo")
t = torch.ones(1 << 20)
dist.all_reduce(t)
print("ready", flush=True)
for _ in range(100000):
    if use_future:
        dist.all_reduce(t, async_op=True).get_future().wait()
    else:
        dist.all_reduce(t)
    t.fill_(1.0)
print("finished without noticing the dead rank", flush=True)
sys.exit(3)
