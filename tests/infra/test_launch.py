"""cadlib.infra.launch and cadlib.infra.groups: torchrun from Python, progress, results, errors, clean stops.

The multiproc tests start real torchrun runs of the tiny scripts in tests/launch_targets/.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.infra import groups as distributed
from cadlib.infra import launch, proctree, progress
from cadlib.infra.groups import init_from_env
from cadlib.infra.launch import TorchrunError, run_torchrun
from cadlib.infra.proctree import terminate_tree
from cadlib.infra.progress import format_progress, parse_progress, read_results, report_progress, write_result

TARGETS = Path(__file__).resolve().parents[1] / "launch_targets"
REPO = Path(__file__).resolve().parents[2]


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZXx"
    except OSError:
        return True


def read_pids(folder: Path) -> list[int]:
    """The worker and launcher pids the hang target wrote (``pid<rank>`` = "pid ppid")."""
    return sorted({int(x) for p in folder.glob("pid*") for x in p.read_text().split()})


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ------------------------------------------------------------------------ validation (no processes)
def test_rendezvous_is_local_unless_an_endpoint_is_given(tmp_path):
    local = launch.torchrun_command(["-m", "cadlib.train"], 2, tmp_path)
    assert "--standalone" in local and not any(a.startswith("--rdzv") for a in local)
    multi = launch.torchrun_command(["-m", "cadlib.train"], 8, tmp_path, nnodes=4, rdzv_endpoint="head:29500")
    assert "--standalone" not in multi
    assert {"--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29500"} <= set(multi)
    with pytest.raises(ValueError, match="nnodes=4 needs rdzv_endpoint"):
        run_torchrun(TARGETS / "ok.py", 2, nnodes=4)
    with pytest.raises(ValueError, match="rdzv_endpoint must be 'host:port'"):
        run_torchrun(TARGETS / "ok.py", 2, nnodes=2, rdzv_endpoint="head")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"nproc": 0}, "nproc must be an integer >= 1"),
    ({"nproc": 2.0}, "nproc must be an integer >= 1"),
    ({"nproc": 2, "pg_backend": "mpi"},
     "unknown process-group backend pg_backend='mpi'; choose one of: auto, gloo, nccl"),
    ({"nproc": 2, "timeout": 0}, "timeout must be a number of seconds > 0"),
    ({"nproc": 2, "timeout": -3}, "timeout must be a number of seconds > 0"),
])
def test_run_torchrun_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        run_torchrun(TARGETS / "ok.py", **kwargs)


def test_run_torchrun_rejects_unknown_targets(tmp_path):
    with pytest.raises(ValueError, match="script .*missing.py.* not found"):
        run_torchrun(tmp_path / "missing.py", 2)
    with pytest.raises(ValueError, match="no module named 'cadlib.no_such_module'"):
        run_torchrun("cadlib.no_such_module", 2)
    with pytest.raises(ValueError, match="no module named 'not a module'"):
        run_torchrun("not a module", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ValueError, match="process-group backend 'nccl' needs CUDA"):
        run_torchrun(TARGETS / "ok.py", 2, pg_backend="nccl")


def test_command_line_matches_torchrun_flags(tmp_path):
    cmd = launch.torchrun_command(["-m", "cadlib.train"], 4, tmp_path, ["--steps", "2"])
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in cmd and cmd[cmd.index("--tee") + 1] == "3"
    assert cmd[cmd.index("--log-dir") + 1] == str(tmp_path)
    assert cmd[-4:] == ["-m", "cadlib.train", "--steps", "2"]
    env = launch.child_env({"FOO": "1", "HOME": None}, "gloo", tmp_path)
    assert env["FOO"] == "1" and "HOME" not in env and env["CADLIB_PG_BACKEND"] == "gloo"
    assert env["CADLIB_RESULTS_DIR"] == str(tmp_path / "results")
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "error.json")
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)


# --------------------------------------------------------------------- progress and result channels
@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 10**6), frac=st.floats(0, 1), desc=st.text(max_size=30))
def test_progress_line_round_trips(total, frac, desc):
    step = int(frac * total)
    line = format_progress(step, total, desc)
    assert "\n" not in line
    assert parse_progress(line) == {"step": step, "total": total, "desc": desc}


def test_progress_rejects_bad_values_and_ignores_other_lines():
    for step, total in [(4, 3), (-1, 3), (0, 0), (1.5, 3), (True, 3)]:
        with pytest.raises(ValueError, match="progress needs"):
            format_progress(step, total)
    for line in ["step 3 of 10", "CADLIB_PROGRESS not json", 'CADLIB_PROGRESS {"step": "a", "total": 2}',
                 'CADLIB_PROGRESS [1, 2]']:
        assert parse_progress(line) is None


def test_report_progress_prints_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    report_progress(1, 2, "x")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    report_progress(1, 2, "x")
    assert parse_progress(capsys.readouterr().out) == {"step": 1, "total": 2, "desc": "x"}


def test_write_result_is_atomic_json_per_rank(monkeypatch, tmp_path):
    monkeypatch.delenv(progress.ENV_RESULTS_DIR, raising=False)
    assert write_result({"a": 1}) is None  # not launched by run_torchrun: nothing to write to
    monkeypatch.setenv(progress.ENV_RESULTS_DIR, str(tmp_path))
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        path = write_result({"rank_sq": torch.tensor(rank) ** 2, "v": torch.arange(3) + rank})
        assert path == tmp_path / f"rank{rank}.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]  # no tmp left
    assert read_results(tmp_path) == {0: {"rank_sq": 0, "v": [0, 1, 2]}, 1: {"rank_sq": 1, "v": [1, 2, 3]}}
    with pytest.raises(TypeError, match="cannot store a object as JSON"):
        write_result({"x": object()})


def test_init_from_env_without_torchrun_gives_a_usable_single_rank_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    d = init_from_env("gloo")
    try:
        assert (d.rank, d.world, d.device, d.pg_backend) == (0, 1, torch.device("cpu"), "gloo")
        t = torch.tensor([2.0, 3.0])
        dist.all_reduce(t, group=d.group)
        assert t.tolist() == [2.0, 3.0]
        assert init_from_env("gloo").group is d.group  # idempotent
    finally:
        distributed.destroy()
    assert not dist.is_initialized()
    with pytest.raises(ValueError,
                       match="unknown process-group backend 'ucc'; choose one of: auto, gloo, nccl"):
        init_from_env("ucc")


# ------------------------------------------------------------------------------------ process trees
def test_terminate_tree_stops_children_in_other_sessions():
    """The launcher's workers run in their own sessions; a group kill alone would orphan them."""
    code = ("import subprocess, sys, time, signal\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "c = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
            "print(c.pid, flush=True)\n"
            "time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(root.stdout.readline())
    found = proctree._descendants(root.pid)
    assert child in found
    try:
        import psutil
        assert set(found) == {c.pid for c in psutil.Process(root.pid).children(recursive=True)}
    except ImportError:
        pass
    stopped = terminate_tree(root.pid, grace=0.5)  # root ignores SIGTERM: needs the SIGKILL
    assert {root.pid, child} <= set(stopped)
    root.wait(timeout=5)
    assert wait_until(lambda: process_gone(child), 5)


# ------------------------------------------------------------------------------- real torchrun runs
@pytest.mark.multiproc
def test_two_ranks_succeed_with_results_progress_and_logs(tmp_path, capsys):
    df = run_torchrun(TARGETS / "ok.py", 2, args="--steps 3", timeout=120, pg_backend="gloo",
                      log_dir=tmp_path)
    assert df["rank"].tolist() == [0, 1]
    assert df["world"].tolist() == [2, 2] and df["sum"].tolist() == [3.0, 3.0]  # all-reduce of rank+1
    assert df["square"].tolist() == [[0], [1]] and (df["pg_backend"] == "gloo").all()
    assert df.attrs["results"][1]["pid"] == df["pid"][1] and df.attrs["missing_ranks"] == []
    assert df.attrs["progress"] == [{"step": s, "total": 3, "desc": "reduce"} for s in (1, 2, 3)]
    logs = Path(df.attrs["log_dir"])
    assert logs.is_relative_to(tmp_path) and logs.name == "attempt_0"
    assert "sum of rank+1 over 2 ranks = 3" in (logs / "0" / "stdout.log").read_text()
    out, err = capsys.readouterr()
    assert "[rank0] sum of rank+1 over 2 ranks = 3" in out and "CADLIB_PROGRESS" not in out
    assert "[rank1] note from rank 1 on stderr" in err and "note from rank 0 on stderr" in err


@pytest.mark.multiproc
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_auto_backend_is_nccl_on_two_gpus(tmp_path):
    df = run_torchrun(TARGETS / "ok.py", 2, args=["--steps", "2"], timeout=300, log_dir=tmp_path,
                      echo=False, progress=False)
    assert df.attrs["pg_backend"] == "nccl" and (df["pg_backend"] == "nccl").all()
    assert df["sum"].tolist() == [3.0, 3.0]


@pytest.mark.multiproc
@pytest.mark.parametrize("target, source, expected", [
    ("fail.py", "error file", ['in explode', 'raise ValueError(f"rank {rank} exploded on purpose")',
                               "ValueError: rank 1 exploded on purpose"]),
    ("crash.py", "stderr.log tail", ["Traceback (most recent call last)",
                                     "KeyError: 'rank 1 lost its key'"]),
])
def test_failing_rank_raises_with_its_traceback(tmp_path, target, source, expected):
    with pytest.raises(TorchrunError) as info:
        run_torchrun(TARGETS / target, 2, timeout=120, log_dir=tmp_path, echo=False)
    err = info.value
    assert isinstance(err, RuntimeError) and err.rank == 1 and err.returncode != 0
    message = str(err)
    assert "root cause: rank 1" in message and f"From its {source}:" in message
    for text in expected:
        assert text in message
    assert err.run_dir.is_relative_to(tmp_path)


@pytest.mark.multiproc
def test_timeout_stops_every_process_of_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(proctree, "KILL_GRACE_S", 1.0)
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(TimeoutError, match="did not finish within 8 s") as info:
        run_torchrun(TARGETS / "hang.py", 2, args=[str(pids)], timeout=8, log_dir=tmp_path, echo=False)
    assert "rank 0 is hanging" in str(info.value)
    assert len(list(pids.glob("pid*"))) == 2, "both ranks must have started before the timeout"
    found = read_pids(pids)
    assert len(found) == 3  # two workers and their torchrun agent
    assert wait_until(lambda: all(process_gone(p) for p in found), 3), found


@pytest.mark.multiproc
def test_ctrl_c_stops_every_process_of_the_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    driver = subprocess.Popen([sys.executable, str(TARGETS / "interrupt_driver.py"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("pid*"))) == 2, 30), "ranks never started"
        found = read_pids(tmp_path)
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=60)     # two busy cores can take a while to stop a run
    finally:
        if driver.poll() is None:
            terminate_tree(driver.pid, grace=0.5)
    assert driver.returncode == 130, out
    assert "KeyboardInterrupt reached the driver" in out
    assert len(found) == 3
    assert wait_until(lambda: all(process_gone(p) for p in found), 3), found
