"""scripts/bench/bench_server_replay.py: per-rank server work of the e2e plans, replayed on one device."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replay():
    path = ROOT / "scripts" / "bench" / "bench_server_replay.py"
    spec = importlib.util.spec_from_file_location("bench_server_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_replays_every_rank_of_every_method(replay, tmp_path):
    out = tmp_path / "r.json"
    assert replay.main(["--smoke", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    rows = res["rows"]
    assert len(rows) == 2 * len(replay.METHODS) * 2                  # batches x methods x ranks
    assert all(r["ms"] > 0 and r["served_q_rows"] > 0 for r in rows)
    # every rank's queries are served once: the ranks' query rows add up to the batch's tokens
    for b in (0, 1):
        for m in replay.METHODS:
            assert sum(r["served_q_rows"] for r in rows if r["batch"] == b and r["method"] == m) == 2 * 512
    # a sent-last server reads its local KV in place: it gathers no more KV rows than without
    for b in (0, 1):
        g = {m: sum(r["gathered_kv_rows"] for r in rows if r["batch"] == b and r["method"] == m)
             for m in ("cad", "cad+sl")}
        assert g["cad+sl"] <= g["cad"]
    assert {"batch", "colocated_max_ms", "colocated_mean_ms"} <= set(res["per_batch"][0])


def test_rejects_bad_flags(replay, capsys):
    for argv, fragment in ((["--methods", "cad,ring"], "unknown method 'ring'"),
                           (["--world", "0"], "--world must be >= 1")):
        with pytest.raises(SystemExit):
            replay.main(argv + ["--out", "/tmp/x.json"])
        assert fragment in capsys.readouterr().err
    with pytest.raises(ValueError, match="method must be one of"):
        replay.plans_of("colocated+sl", None, None)
