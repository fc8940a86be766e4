"""A job that calls memrt.comm directly (no MEMRT needed): init, one all-reduce, teardown.

    torchrun --standalone --nproc-per-node 2 tests/scripts/comm_api_job.py

Rank 0 prints ``sum [3.0, 3.0, 3.0, 3.0]`` with two ranks.
"""

import torch

import memrt.comm as dist


def main() -> None:
    dist.init_process_group("gloo")
    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        print("sum", x.tolist(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
