"""Several nodes on one machine (cadlib.infra.nodes.run_nodes): two and three torchrun agents of two
gloo ranks each, in one c10d rendezvous on 127.0.0.1, run ``cadlib.verify``, and three run a short
``cadlib.train`` (colocated and cad-pingpong under ``--pp 2``; two nodes without stages are
tests/infra/test_slurm.py's), and give what one agent with as many ranks gives (tests/ranks.py), bit for
bit: every case's errors and loads, every loss, every dumped gradient. Each rank reads its node from
the launcher (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), writes its result on its node's
disk, and the launcher collects them all.

A node whose agent dies, and a rendezvous that never completes (the second node never started), end
the run with an error naming the node within a stated time, and nothing of the run is left running.
"""
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import ranks
import torch

from cadlib.infra import launch, nodes, proctree
from cadlib.infra.launch import TorchrunError, run_torchrun
from cadlib.infra.nodes import run_nodes

TARGETS = Path(__file__).resolve().parents[1] / "launch_targets"
VERIFY = ["--tokens-per-rank", "256", "--case", "random,spanning,empty-rank", "--dtype", "fp32"]
TRAIN = ["--methods", "colocated,cad-pingpong", "--tokens-per-rank", "128", "--max-doc-len", "200",
         "--min-shard", "16", "--steps", "2", "--warmup", "0", "--dtype", "fp32"]


def run_marked(run_id: str) -> list[int]:
    """The live processes of a run: those whose environment carries its ``$CADLIB_RUN`` marker,
    read with psutil (independently of cadlib.infra.proctree, which the launcher uses)."""
    psutil = pytest.importorskip("psutil")
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(launch.ENV_RUN) == run_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def check_layout(df, nnodes: int, nproc: int = 2) -> None:
    """Every rank's result landed and was collected; node k holds ranks k*nproc.., and each rank read
    that layout from the launcher."""
    world = nnodes * nproc
    assert df["rank"].tolist() == list(range(world)) and df.attrs["missing_ranks"] == []
    assert df["node"].tolist() == [r // nproc for r in range(world)]
    assert df["group_rank"].tolist() == df["node"].tolist()
    assert df["local_rank"].tolist() == [r % nproc for r in range(world)]
    assert (df["local_world"] == nproc).all() and (df["world"] == world).all()
    run_dir = Path(df.attrs["run_dir"])
    for r, k in zip(df["rank"], df["node"]):
        assert (run_dir / f"node{k}" / "results" / f"rank{r}.json").is_file()   # on its node's disk
        assert (run_dir / "results" / f"rank{r}.json").is_file()                # and collected


# ------------------------------------------------------------------------ validation (no processes)
def test_node_commands_and_arguments(tmp_path):
    cmd = launch.torchrun_command(["-m", "cadlib.train"], 2, tmp_path, nnodes=3,
                                  rdzv_endpoint="127.0.0.1:2950", join_timeout=7.5,
                                  local_addr=nodes.node_addr(2))
    assert {"--nnodes=3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:2950",
            "--rdzv-conf=join_timeout=8", "--local-addr=127.0.0.3", "--nproc-per-node=2"} <= set(cmd)
    assert sorted(nodes.node_addr(k) for k in range(nodes.MAX_LOCAL_NODES)) == \
        [nodes.node_addr(k) for k in range(nodes.MAX_LOCAL_NODES)]     # torch numbers nodes in this order
    assert nodes.node_devices(2, 2, ["0", "1", "2", "3", "4"]) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match=r"nnodes x nproc_per_node = 3 x 2 GPUs, but 4 are visible"):
        nodes.node_devices(3, 2, ["0", "1", "2", "3"])
    for kwargs, fragment in (({"nnodes": 0}, "nnodes must be an integer from 1 to 9"),
                             ({"nnodes": 10}, "nnodes must be an integer from 1 to 9"),
                             ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1"),
                             ({"join_timeout": 0}, "join_timeout must be a number of seconds > 0"),
                             ({"pg_backend": "mpi"}, "unknown process-group backend pg_backend='mpi'")):
        with pytest.raises(ValueError, match=fragment):
            run_nodes(TARGETS / "ok.py", **{"nnodes": 2, "nproc_per_node": 2, **kwargs})


# ------------------------------------------------------------------ the same results as one agent
@pytest.mark.multiproc
@pytest.mark.parametrize("nnodes", [2, 3])
def test_verify_on_nodes_equals_one_agent(nnodes):
    df = run_nodes("cadlib.verify", nnodes, 2, VERIFY, timeout=240, pg_backend="gloo", echo=False,
                   progress=False)
    check_layout(df, nnodes)
    ref = ranks.run("cadlib.verify", 2 * nnodes, VERIFY)
    assert set(ref["group_rank"]) == {0} and (ref["local_world"] == 2 * nnodes).all()    # one agent
    timing = "first_fwd_bwd_s"                                    # wall time, the only field that may differ
    for got, want in zip(df.attrs["results"], ref.attrs["results"], strict=True):
        assert got["passed"] and got["checked"] == 3
        strip = [[{k: v for k, v in c.items() if k != timing} for c in r["cases"]] for r in (got, want)]
        assert strip[0] == strip[1]


@pytest.mark.multiproc
def test_train_on_nodes_equals_one_agent(tmp_path):
    """Three nodes under --pp 2 (stages and their data-parallel groups straddle nodes); two nodes
    without stages are tests/infra/test_slurm.py's run of scripts/slurm/train.sbatch."""
    nnodes, pp = 3, 2
    argv = TRAIN + ["--pp", str(pp)]
    df = run_nodes("cadlib.train", nnodes, 2, argv + ["--dump-grads", str(tmp_path / "nodes")], timeout=240,
                   pg_backend="gloo", echo=False, progress=False)
    check_layout(df, nnodes)
    ref = ranks.run("cadlib.train", 2 * nnodes, argv + ["--dump-grads", str(tmp_path / "one")])
    losses = [[(r["method"], r["batch"], r["loss"]) for r in res["records"]] for res in df.attrs["results"]]
    assert losses == [[(r["method"], r["batch"], r["loss"]) for r in res["records"]]
                      for res in ref.attrs["results"]]
    by_method = {m: [loss for mm, _, loss in losses[0] if mm == m] for m in ("colocated", "cad-pingpong")}
    assert len(by_method["colocated"]) == 2
    assert torch.allclose(torch.tensor(by_method["cad-pingpong"]), torch.tensor(by_method["colocated"]),
                          rtol=0, atol=1e-4)                      # and the two methods agree
    files = sorted(p.name for p in (tmp_path / "nodes").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(files) == 2 * pp                                  # per method (and stage)
    for name in files:
        got, want = torch.load(tmp_path / "nodes" / name), torch.load(tmp_path / "one" / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), name


# --------------------------------------------------------------------------------------- failures
@pytest.mark.multiproc
def test_a_node_whose_agent_dies_ends_the_run_and_nothing_survives(tmp_path, monkeypatch):
    """Node 1's agent is killed while every rank runs: the run ends at once naming node 1, and node 0
    (whose rank 1 ignores SIGTERM) and node 1's orphaned workers are stopped."""
    monkeypatch.setattr(proctree, "KILL_GRACE_S", 1.0)
    pids = tmp_path / "pids"
    pids.mkdir()
    killed = {}

    def kill_node_1():
        if wait_until(lambda: len(list(pids.glob("pid*"))) == 4, 60):
            killed["agent"] = int((pids / "pid2").read_text().split()[1])   # rank 2's parent: node 1's agent
            killed["at"] = time.monotonic()
            os.kill(killed["agent"], signal.SIGKILL)

    killer = threading.Thread(target=kill_node_1, daemon=True)
    killer.start()
    with pytest.raises(TorchrunError) as info:
        run_nodes(TARGETS / "hang.py", 2, 2, [str(pids)], timeout=90, log_dir=tmp_path, echo=False,
                  progress=False)
    ended = time.monotonic() - killed["at"]
    killer.join()
    err = info.value
    assert err.node == 1 and err.returncode == -signal.SIGKILL
    assert f"node 1 of 2: its torchrun agent (pid {killed['agent']}) was killed by SIGKILL" in str(err)
    assert re.search(r"\nnode 0 (was still running|had exited with -?\d+); stopped the run's \d+ processes",
                     str(err))
    assert ended < proctree.KILL_GRACE_S + 8, ended       # seen within 0.1 s, stopped within the grace
    run_id = str(err.run_dir.parent)
    every = {int(x) for p in pids.glob("pid*") for x in p.read_text().split()}
    assert len(every) == 6                                        # 4 workers and 2 agents
    assert wait_until(lambda: not run_marked(run_id), 3), run_marked(run_id)
    assert wait_until(lambda: all(not os.path.exists(f"/proc/{p}") or
                                  open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
                                  for p in every), 3)


@pytest.mark.multiproc
def test_a_rendezvous_that_never_completes_ends_after_join_timeout(tmp_path):
    """One node of two started (the other never comes): its agent gives up after join_timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TorchrunError) as info:
        run_torchrun(TARGETS / "ok.py", 2, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", join_timeout=3,
                     timeout=60, pg_backend="gloo", log_dir=tmp_path, echo=False, progress=False)
    took = time.monotonic() - t0
    message = str(info.value)
    assert f"this node ({socket.gethostname()}): the c10d rendezvous of 2 nodes at 127.0.0.1:{port} did " \
           "not complete within join_timeout=3 s: not every node joined" in message
    assert took < 3 + 20, took                                    # the agent's start-up, then 3 s
    assert not run_marked(str(info.value.run_dir))
