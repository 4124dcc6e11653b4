"""Failure target without ``record``: rank 1 raises, so only its stderr.log holds the traceback."""
import os

rank = int(os.environ["RANK"])
if rank == 1:
    raise KeyError(f"rank {rank} lost its key")
