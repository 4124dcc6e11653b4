"""Failure target: rank 1 raises; ``record`` makes torchrun keep its traceback in an error file."""
import os

from torch.distributed.elastic.multiprocessing.errors import record


def explode(rank):
    raise ValueError(f"rank {rank} exploded on purpose")


@record
def main():
    rank = int(os.environ["RANK"])
    print(f"rank {rank} started", flush=True)
    if rank == 1:
        explode(rank)


if __name__ == "__main__":
    main()
