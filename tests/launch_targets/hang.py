"""Hanging target: each rank writes ``pid<rank>`` = "pid ppid" into argv[1] and sleeps forever.

Rank 1 ignores SIGTERM, so stopping the run needs the launcher's SIGKILL. No torch import: fast.
"""
import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
if rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
tmp = os.path.join(sys.argv[1], f".pid{rank}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}")
os.replace(tmp, os.path.join(sys.argv[1], f"pid{rank}"))
print(f"rank {rank} is hanging", flush=True)
while True:
    time.sleep(1)
