"""scripts/slurm/train.sbatch under stand-ins of SLURM's ``srun`` and ``scontrol`` (tests/infra/slurm/,
first on PATH) on one machine: the batch script runs as SLURM runs it (in the submit folder, with the
allocation's variables), srun starts one torchrun agent per "node" with the variables a task gets, and
the agents meet in the c10d rendezvous on the first host of the node list (127.0.0.1).

Two nodes of two gloo ranks train colocated and cad-pingpong: every rank's result lands in
``runs/slurm-<job>/results`` with the node layout the launcher gave, torch's logs in
``runs/slurm-<job>/torch/node<k>``, and losses and gradients equal one agent's with four ranks. When a
node never comes up, the other gives up after the rendezvous' join timeout and the job fails with a
line naming that node.
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ranks
import torch

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STAND_INS = Path(__file__).resolve().parent / "slurm"
TRAIN = ["--methods", "colocated,cad-pingpong", "--tokens-per-rank", "128", "--max-doc-len", "200",
         "--min-shard", "16", "--steps", "2", "--warmup", "0", "--dtype", "fp32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbatch(submit: Path, args, job: str, timeout: float, **extra):
    """``bash train.sbatch args`` as the batch step of a 2-node allocation with 2 GPUs a node."""
    env = dict(os.environ, PATH=f"{STAND_INS}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=job,
               SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(submit),
               SLURM_GPUS_ON_NODE="2", RDZV_PORT=str(free_port()), CADLIB_PYTHON=sys.executable,
               CADLIB_PG_BACKEND="gloo", OMP_NUM_THREADS="1", SRUN_STANDIN_LOG=str(submit / "srun.log"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra)
    env.pop("CADLIB_RESULTS_DIR", None)
    return subprocess.run(["bash", str(SBATCH), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_stand_ins_expand_node_lists():
    out = subprocess.run([str(STAND_INS / "scontrol"), "show", "hostnames", "gpu[01-03,7],login"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]


@pytest.mark.multiproc
def test_sbatch_trains_on_two_nodes_like_one_agent(tmp_path):
    job = "4242"
    done = sbatch(tmp_path, TRAIN + ["--dump-grads", str(tmp_path / "grads")], job, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cadlib: 2 nodes x 2 ranks, rendezvous at 127.0.0.1:" in done.stdout
    calls = [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    assert len(calls) == 1 and calls[0][0] == "--kill-on-bad-exit=1"
    run = tmp_path / "runs" / f"slurm-{job}"                      # paths relative to the submit folder
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in (run / "results").glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["local_world"] == 2 for r in results.values())
    assert sorted((r["group_rank"], r["local_rank"]) for r in results.values()) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(p.name for p in (run / "torch").iterdir()) == ["node0", "node1"]
    ref = ranks.run("cadlib.train", 4, TRAIN + ["--dump-grads", str(tmp_path / "one")])
    assert [[(x["method"], x["batch"], x["loss"]) for x in results[r]["records"]] for r in range(4)] == \
        [[(x["method"], x["batch"], x["loss"]) for x in res["records"]] for res in ref.attrs["results"]]
    for name in ("colocated.pt", "cad-pingpong.pt"):
        got, want = torch.load(tmp_path / "grads" / name), torch.load(tmp_path / "one" / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), name


@pytest.mark.multiproc
def test_sbatch_names_the_node_when_another_never_comes_up(tmp_path):
    t0 = time.monotonic()
    done = sbatch(tmp_path, ["--steps", "1"], "4343", timeout=120, SRUN_STANDIN_SKIP="1",
                  RDZV_JOIN_TIMEOUT="3")
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RendezvousTimeoutError" in done.stderr
    assert "cadlib: node 0 (127.0.0.1) ended with exit code 1; its ranks' logs: " \
           f"{tmp_path}/runs/slurm-4343/torch/node0" in done.stderr
    assert took < 3 + 30, took
