"""What does a server call timed without a warm-up pay beside its kernel?

``bench_replay.py time --warmup 0`` halves the time it takes to time the paper protocol's server calls, as
torch's FA2 compiles nothing per shape. This probe measures what the missing warm-up costs: the same
server calls (the first ``--calls`` of batch 1 of four paper-protocol 3D settings) timed in one process,
forward and backward, in five passes:

* ``A``: no warm-up, in a fresh process (its first calls load kernel variants);
* ``B``: no warm-up again (the caching allocator now holds blocks of these sizes);
* ``C``: no warm-up, after emptying the allocator and reserving its pool
  (:func:`cadlib.bench.timer.reserve_pool`);
* ``D``: one untimed warm-up run first (the reference);
* ``E``: one warm-up run, and each timed run queued behind a ~10 ms device sleep
  (``time_phases(ahead=True)``), so the forward's host work (Python, the gather's indices, the kernel's
  launch) runs while the device is busy, as in a training step, instead of on an idle device.

Each pass against ``D``: the ratio of the sums and the median ratio and difference, per direction; with
``--cache``, the same for the cache's timings of these calls (how the cache's entries were timed).

    python scripts/probes/probe_warmup.py --out $OUT/warmup_probe_h200.json            # 1x H200, ~2 min
    python scripts/probes/probe_warmup.py --device cpu --smoke --out /tmp/w.json        # harness only
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from cadlib.analysis.replay import phases as rp
from cadlib.analysis.replay import protocol
from cadlib.analysis.replay import settings as replay
from cadlib.analysis.replay import times as rt
from cadlib.bench.inputs import ServeCall
from cadlib.bench.timer import RESERVE_GIB, reserve_pool, time_phases
from cadlib.infra.results import load_result, save_result
from cadlib.runtime.device import to_device

PASSES = {"A": "no warm-up, fresh process", "B": "no warm-up, again", "C": "no warm-up, pool reserved",
          "D": "one warm-up run", "E": "one warm-up run, host work hidden behind a device sleep"}


def compare(x: np.ndarray, ref: np.ndarray) -> dict:
    """``x`` against ``ref`` (``[calls, 2]``: forward, backward ms): per direction the ratio of the sums,
    the median ratio and the median difference (ms)."""
    if x.shape != ref.shape or x.ndim != 2 or x.shape[1] != 2:
        raise ValueError(f"x and ref must both be [calls, 2], got {x.shape} and {ref.shape}")
    return {f: {"sum_ratio": float(x[:, j].sum() / ref[:, j].sum()),
                "median_ratio": float(np.median(x[:, j] / ref[:, j])),
                "median_diff_ms": float(np.median(x[:, j] - ref[:, j]))}
            for j, f in enumerate(("fwd", "bwd"))}


def summarise(raw: dict, cache: dict | None = None) -> dict:
    """Every pass that timed every call (and the cache's timings, where it holds every call) against pass
    ``D``."""
    keys = sorted(raw)
    ref = np.array([raw[k]["D"] for k in keys])
    out = {p: compare(np.array([raw[k][p] for k in keys]), ref) for p in PASSES
           if p != "D" and all(p in raw[k] for k in keys)}
    if cache is not None and all(k in cache for k in keys):
        out["cache"] = compare(np.array([[cache[k]["fwd_ms"], cache[k]["bwd_ms"]] for k in keys]), ref)
    return {"calls": len(keys), "passes": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--calls", type=int, default=40, help="calls per setting")
    ap.add_argument("--reserve-gib", type=float, default=RESERVE_GIB)
    ap.add_argument("--cache", default=None, help="a replay cache whose timings of these calls to compare")
    ap.add_argument("--smoke", action="store_true", help="the tiny CPU setting (sdpa_ref)")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error(f"--calls must be >= 1, got {a.calls}")
    if a.reserve_gib < 0:
        ap.error(f"--reserve-gib must be >= 0, got {a.reserve_gib}")
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rates = rp.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                          load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    if a.smoke:
        todo = replay.smoke_settings()
        backend = "sdpa_ref"
    else:
        todo = [s for d in protocol.PAPER_DISTS for s in protocol.paper_3d(d, 2)
                if s.max_doc_len in (131072, 262144)][:4]
        backend = "torch_flash"
    calls = []
    for s in todo:
        jobs = rt.attention_jobs(rp.batch_work(s, 1, rates).values(), s.spec, backend)
        calls += [(s, k, d) for k, d in list(jobs.items())[:a.calls]]
    raw = {k: {} for _, k, _ in calls}

    def one(p: str, warmup: int, ahead: bool = False) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        for s, k, d in calls:
            call = ServeCall(to_device(d, dev), s.spec, dev, dtype, backend, gen)
            fw, bw = time_phases([call.forward, call.backward], dev, iters=1, warmup=warmup,
                                 after=call.zero_grad, ahead=ahead)
            raw[k][p] = [fw[0], bw[0]]
        print(f"pass {p} ({PASSES[p]}): {len(calls)} calls", flush=True)

    one("A", 0)
    one("B", 0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    reserve_pool(dev, a.reserve_gib)
    one("C", 0)
    one("D", 1)
    one("E", 1, ahead=True)
    cache = json.loads(Path(a.cache).read_text())["times"] if a.cache else None
    res = summarise(raw, cache)
    save_result(a.out, {"settings": [s.name for s in todo], "batch": 1, "calls_per_setting": a.calls,
                        "backend": backend, "reserve_gib": a.reserve_gib, "passes": PASSES},
                {**res, "raw": raw})
    for p, r in res["passes"].items():
        print(f"{p}: forward {r['fwd']['sum_ratio']:.3f}, backward {r['bwd']['sum_ratio']:.3f} of the "
              f"warmed-up time (sums)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
