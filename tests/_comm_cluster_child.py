"""Child of test_comm_cluster: discovery on an emulated 2-node cluster + one hierarchical all-reduce."""

import torch

import memrt.comm as dist

dist.init_process_group("gloo")
topo = dist.get_topology()
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.arange(1 << 20, dtype=torch.int64) * (rank + 1)
dist.all_reduce(x)
ok = torch.equal(x, torch.arange(1 << 20, dtype=torch.int64) * sum(range(1, world + 1)))
print(f"RESULT nodes={[list(n) for n in topo.nodes]} source={topo.source} ok={ok}", flush=True)
dist.destroy_process_group()
