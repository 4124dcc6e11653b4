"""Calls run_torchrun on hang.py (pid folder = argv[1]) until SIGINT; exits 130 on KeyboardInterrupt."""
import signal
import sys
from pathlib import Path

from cadlib.infra import launch, proctree

# A shell that starts the tests in the background (`make test &`, some CI runners) hands its children
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the Ctrl-C this test sends would
# never arrive. A terminal's Ctrl-C reaches a run as Python's default handler delivers it; install it.
signal.signal(signal.SIGINT, signal.default_int_handler)
proctree.KILL_GRACE_S = 1.0            # what run_torchrun waits before SIGKILL
try:
    launch.run_torchrun(Path(__file__).with_name("hang.py"), 2, args=[sys.argv[1]], timeout=120,
                        echo=True, progress=False)
except KeyboardInterrupt:
    print("KeyboardInterrupt reached the driver", flush=True)
    sys.exit(130)
print("run_torchrun returned without an interrupt", flush=True)
sys.exit(1)
