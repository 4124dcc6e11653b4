"""Two-rank success target: an all-reduce, progress lines, one result per rank.

torchrun --standalone --nproc-per-node=2 tests/launch_targets/ok.py --steps 3
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from cadlib.infra.groups import destroy, init_from_env
from cadlib.infra.progress import log, report_progress, write_result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    d = init_from_env()
    total = torch.tensor([float(d.rank + 1)], device=d.device)
    for step in range(1, opts.steps + 1):
        report_progress(step, opts.steps, "reduce")
    dist.all_reduce(total, group=d.group)
    log(f"sum of rank+1 over {d.world} ranks = {total.item():g}")
    print(f"note from rank {d.rank} on stderr", file=sys.stderr, flush=True)
    write_result({"world": d.world, "sum": total.item(), "pg_backend": d.pg_backend, "steps": opts.steps,
                  "pid": os.getpid(), "square": torch.tensor([d.rank]) ** 2})
    destroy()


if __name__ == "__main__":
    main()
