"""The scale replay's committed results as tables, and ours against the paper's claims they cover
(``results/replay/``, written by ``scripts/bench/bench_replay.py compose``; :mod:`cadlib.analysis.replay.settings`).

* :func:`summary`: one row per (setting, method) of a summary file;
* :func:`speedups`: CAD with ping-pong over WLB-ideal and over colocated per 3D setting, beside the
  simulator's prediction and the paper's range; :func:`speedups_4d` the same for Table 4's 4D settings,
  and :func:`sample_check_4d` those whose every call was timed against the sampled replay;
* :func:`validation`: the replayed DP=2 steps against the measured 2x H200 ones, per setting and batch;
* :func:`ranks`: one batch's per-rank attention (the straggler picture);
* :func:`pingpong_ablation`, :func:`idle`, :func:`allgather`: the ablation and the motivation's figures;
* :func:`record_claims`: ours against the registry's claims these cover, one call.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...core.methods import names
from ...core.paper import CLAIMS, DISTCA_FIG3_ALLGATHER, DISTCA_FIG4B_IDLE
from ...infra.results import RESULTS_DIR, load_result
from . import claims

REPLAY_DIR = RESULTS_DIR / "replay"
HOW = ("every rank's compute of 5 sampled batches per setting timed on 1x H200 (FA4; FA2 x the fitted "
       "FA4/FA2 ratio where FA4 was not timed), TP=8 shard per GPU, the network modelled at 50 GB/s per "
       "GPU between nodes (scripts/bench/bench_replay.py)")


PROTOCOL_TAG = "_paper"
"""The replay under the paper's protocol (:mod:`cadlib.analysis.replay.protocol`; FA2, the paper's kernel):
the 3D claims are answered from it. ``_paper_fa4`` is the same with FA4; ``_3d`` our earlier protocol
(its choices are the protocol's variants, ``docs/fidelity.md``)."""
HOW_PAPER = ("Table 3's Llama-8B settings (64-256 GPUs, TP=8, MaxDocLen 128K-512K) under the paper's protocol "
             "as DistCA's code runs it: its samplers, sequences of MaxDocLen tokens, ping and pong from "
             "separate sequences, WLB-ideal one CP degree per setting (the better of the two largest), "
             "DistCA's planner and tolerance rule, resend backward, 15 sampled steps; FA2 server calls "
             "{timed}, the fused linear layers timed on the TP=8 shard, the network at 50 GB/s per GPU "
             "(scripts/bench/bench_replay.py compose --suite paper3d)")
"""How the 3D claims were measured; ``{timed}``: which server calls were timed call by call (from the
replay files' ``batches_timed``), filled in by :func:`record_claims` with :func:`how_timed`."""


def how_timed(lo: int, hi: int, batches: int) -> str:
    """What :data:`HOW_PAPER` says of the timing when ``lo``-``hi`` of ``batches`` steps per setting had
    every call timed."""
    if lo >= batches:
        return f"of all {batches} steps timed one by one on 1x H200"
    some = f"{lo}-{hi}" if lo < hi else f"{lo}"
    return (f"timed on 1x H200 (every call of {some} of the {batches} steps of each setting; the others from "
            "the kernel table corrected per call by a model fitted on the timed ones)")
HOW_4D_PAPER = ("Table 4's Llama-8B settings (64-256 GPUs, TP=8, MaxDocLen 128K-512K, Table 4's batch of "
                "MaxDocLen sequences) under the paper's protocol: DistCA's samplers and sequences, its "
                "configuration grid (PP, CP, micro-batches) filtered by the memory model for both methods, "
                "1F1B per DP replica (WLB-ideal) and DistCA's lock-step ticks with its per-tick tolerance rule "
                "(CAD), one configuration per method and setting by mean step, 10 steps; attention from the "
                "FA2 kernel table scaled to 536 of its own calls timed on 1x H200 (30 a setting, sampled "
                "from its first step; scripts/bench/bench_replay.py compose --suite paper4d --fitting-only)")
HOW_4D = ("the 4D settings of Table 4 (Llama-8B, TP=8, 64-256 GPUs) composed from the 3D replay's H200 "
          "timings of the linear layers, head and optimizer, attention from 40 calls per setting timed on an "
          "H200 and the FA4 kernel table scaled to them (4 settings timed call by call agree within 1% of the "
          "step), 1F1B (colocated, WLB-ideal) or DistCA's lock-step ticks (CAD), 3 sampled steps, the "
          "network at 50 GB/s per GPU (scripts/bench/bench_replay.py compose --suite 4d)")


def _load(name: str, results_dir=None) -> dict:
    return load_result((results_dir or REPLAY_DIR) / name)


def summary(tag: str = "_3d", results_dir=None) -> pd.DataFrame:
    """One row per (setting, method) of ``replay_summary<tag>.json`` (``_3d``, ``_3d_fa2``,
    ``_validation``, ``_scenarios``)."""
    return pd.DataFrame(_load(f"replay_summary{tag}.json", results_dir)["results"])


def per_batch(setting: str, tag: str = "_3d", results_dir=None) -> pd.DataFrame:
    """One row per (batch, method) of one setting's file."""
    return pd.DataFrame(_load(f"replay_{setting}{tag}.json", results_dir)["results"]["per_batch"])


def speedups(tag: str = "_3d", results_dir=None) -> pd.DataFrame:
    """Per 3D setting: CAD with ping-pong over WLB-ideal and over colocated (mean over batches, and
    the per-batch extremes), the simulator's, and the paper's range for the setting's distribution."""
    s = summary(tag, results_dir)
    pp = s[s.method == "cad-pingpong"].copy()
    pp["dist"] = pp.setting.str.split("_").str[1]
    pp["context_k"] = pp.max_doc_len // 1024
    pp["min_over_wlb"] = pp.speedup_over_wlb_per_batch.map(min)
    pp["max_over_wlb"] = pp.speedup_over_wlb_per_batch.map(max)
    lo_hi = {d: CLAIMS[f"distca.speedup_3d_{d}"].paper for d in ("pretrain", "prolong")}
    pp["paper_low"] = pp.dist.map(lambda d: lo_hi[d][0])
    pp["paper_high"] = pp.dist.map(lambda d: lo_hi[d][1])
    cols = ["dist", "context_k", "dp", "batches", "batches_timed", "speedup_over_wlb", "speedup_over_wlb_sem", "min_over_wlb",
            "max_over_wlb", "sim_speedup_over_wlb", "speedup_over_colocated", "paper_low", "paper_high"]
    cols = [c for c in cols if c in pp]      # the protocol runs no colocated; older files lack _sem, _timed
    return pp[cols].sort_values(["dist", "context_k", "dp"]).reset_index(drop=True)


def gain_breakdown(tag: str = PROTOCOL_TAG, results_dir=None) -> pd.DataFrame:
    """Where CAD's gain over WLB-ideal comes from, per 3D setting: each method's mean step split into its
    slowest rank's core attention, its exposed communication and the rest (linear layers, head,
    optimizer, waiting), WLB-ideal at the CP degree the setting chose; ``gain_s`` is WLB-ideal's step
    minus CAD's, and ``gather_share`` the part of it that WLB-ideal's exposed all-gather accounts for."""
    s = summary(tag, results_dir)
    rows = []
    for setting, g in s.groupby("setting", sort=False):
        cp = int(g[g.method == "wlb"].wlb_cp.iloc[0])
        b = per_batch(setting, tag, results_dir)
        row = {"setting": setting.removeprefix("3d_"), "wlb_cp": cp}
        for name, method in (("wlb", f"wlb/{cp}"), ("cad", "cad-pingpong")):
            m = b[b.method == method]
            if m.empty:
                raise ValueError(f"{setting}: no {method!r} rows in replay_{setting}{tag}.json")
            step, attn, comm = m.step_s.mean(), m.attention_max_s.mean(), m.exposed_comm_s.mean()
            row |= {f"{name}_step_s": step, f"{name}_attention_s": attn, f"{name}_comm_s": comm,
                    f"{name}_rest_s": step - attn - comm}
        row["gain_s"] = row["wlb_step_s"] - row["cad_step_s"]
        row["gather_share"] = (row["wlb_comm_s"] - row["cad_comm_s"]) / row["gain_s"]
        row["speedup"] = row["wlb_step_s"] / row["cad_step_s"]
        rows.append(row)
    return pd.DataFrame(rows)


def validation(results_dir=None) -> pd.DataFrame:
    """Per committed 2x H200 setting and method: the replayed step against the measured one (the error
    of the mean, and the per-batch errors), raw and with the timings scaled to the run's GPU
    (``device_ratio``, :func:`cadlib.analysis.replay.results.device_ratio`: ``on_gpu_*``), and the
    speedup over colocated, replayed and measured."""
    s = summary("_validation", results_dir)
    s = s[~s.method.str.contains("/")].copy()
    rows = []
    for setting, g in s.groupby("setting", sort=False):
        b = per_batch(setting, "_validation", results_dir)
        col = b[b.method == "colocated"].set_index("batch")
        for _, r in g.iterrows():
            m = b[b.method == r.method].set_index("batch")
            rows.append({"setting": setting.removeprefix("e2e_2x_"), "method": r.method,
                         "err_of_mean": r.replay_vs_measured_err_of_mean,
                         "err_min": min(r.replay_vs_measured_err_per_batch),
                         "err_max": max(r.replay_vs_measured_err_per_batch),
                         "device_ratio": r.get("device_ratio", float("nan")),
                         "on_gpu_err_of_mean": r.get("on_run_gpu_err_of_mean", float("nan")),
                         "on_gpu_err_min": min(r.get("on_run_gpu_err_per_batch", [float("nan")])),
                         "on_gpu_err_max": max(r.get("on_run_gpu_err_per_batch", [float("nan")])),
                         "speedup_replayed": float((col.step_s / m.step_s).mean()),
                         "speedup_measured": float((col.measured_step_s / m.measured_step_s).mean())})
    return pd.DataFrame(rows)


def speedups_4d(view: str = "budget", results_dir=None) -> pd.DataFrame:
    """Per 4D setting (Table 4): CAD with ping-pong over WLB-ideal and over colocated, each method at
    its best configuration in ``view`` (``budget``: configurations whose ranks stay within the
    microbatch's tokens, the paper's WLB fitting memory; ``any``; ``pp=<n>``), with the
    configurations chosen and the paper's range for the distribution."""
    s = summary("_4d", results_dir)
    s = s[s.view == view]
    cad = s[s.method == "cad-pingpong"].set_index("setting")
    wlb = s[s.method == "wlb"].set_index("setting")
    out = pd.DataFrame({"dist": cad.dist.str.replace("distca-", ""), "context_k": cad.max_doc_len // 1024,
                        "gpus": cad.gpus, "batch": cad.batch, "speedup_over_wlb": cad.speedup_over_wlb,
                        "speedup_over_colocated": cad.speedup_over_colocated,
                        "cad_pp": cad.pp, "wlb_pp": wlb.pp, "wlb_cp": wlb.cp,
                        "wlb_max_tokens_per_rank": wlb.max_tokens_per_rank})
    lo_hi = {d: CLAIMS[f"distca.speedup_4d_8b_{d}"].paper for d in ("pretrain", "prolong")}
    out["paper_low"] = out.dist.map(lambda d: lo_hi[d][0])
    out["paper_high"] = out.dist.map(lambda d: lo_hi[d][1])
    return out.reset_index().sort_values(["dist", "context_k", "gpus"]).reset_index(drop=True)


def speedups_4d_paper(view: str = "paper", results_dir=None) -> pd.DataFrame:
    """Per 4D setting under the paper's protocol (``replay_summary_4d_paper.json``,
    :func:`cadlib.analysis.replay.protocol.paper_4d`): CAD with ping-pong over WLB-ideal with its standard
    error, each method at its configuration of least mean step among those the memory model fits
    (``view="paper"``; ``"oracle"``: WLB-ideal's best configuration batch by batch), the configurations
    chosen, their modelled peaks, and the paper's range."""
    s = summary("_4d_paper", results_dir)
    s = s[s.view == view]
    cad = s[s.method == "cad-pingpong"].set_index("setting")
    wlb = s[s.method == "wlb"].set_index("setting")
    out = pd.DataFrame({"dist": cad.dist.str.replace("-distca", ""), "context_k": cad.max_doc_len // 1024,
                        "gpus": cad.gpus, "batch": cad.batch, "batches": cad.batches,
                        "speedup_over_wlb": cad.speedup_over_wlb, "speedup_over_wlb_sem": cad.speedup_se,
                        "cad_pp": cad.pp, "cad_peak_gib": cad.peak_gib, "wlb_pp": wlb.pp, "wlb_cp": wlb.cp,
                        "wlb_micro": wlb.n_micro, "wlb_peak_gib": wlb.peak_gib})
    lo_hi = {d: CLAIMS[f"distca.speedup_4d_8b_{d}"].paper for d in ("pretrain", "prolong")}
    out["paper_low"] = out.dist.map(lambda d: lo_hi[d][0])
    out["paper_high"] = out.dist.map(lambda d: lo_hi[d][1])
    return out.reset_index().sort_values(["dist", "context_k", "gpus"]).reset_index(drop=True)


def sample_check_4d(tag: str = "_4d_timed", views=("any", "budget"), results_dir=None) -> pd.DataFrame:
    """The 4D settings whose every server call was timed (``replay_summary<tag>.json``) against the same
    settings in the committed 4D replay (attention from the timed sample and the kernel table scaled to
    it): per (setting, view, method) both steps and speedups over WLB-ideal, and their differences."""
    timed, base = summary(tag, results_dir), summary("_4d", results_dir)
    key = ["setting", "view", "method"]
    timed, base = timed[timed.view.isin(views)], base[base.view.isin(views)]
    m = base[key + ["step_s_mean", "speedup_over_wlb", "pp"]].merge(
        timed[key + ["step_s_mean", "speedup_over_wlb", "pp"]], on=key, suffixes=("_sampled", "_timed"))
    m["step_err"] = m.step_s_mean_sampled / m.step_s_mean_timed - 1
    m["speedup_diff"] = m.speedup_over_wlb_sampled - m.speedup_over_wlb_timed
    return m.sort_values(key).reset_index(drop=True)


def ranks(setting: str = "3d_pretrain_512k_dp8", batch: int = 0, tag: str = "_3d",
          methods=names(headline=True), results_dir=None) -> pd.DataFrame:
    """One batch's per-rank attention (forward + backward, ms per layer) for ``methods``."""
    d = _load(f"replay_{setting}{tag}.json", results_dir)["results"]["ranks"]
    rows = [{"method": r["method"], "rank": i, "attention_ms": a}
            for r in d if r["batch"] == batch and r["method"] in methods
            for i, a in enumerate(np.ravel(r["attention_ms_per_layer"]))]
    return pd.DataFrame(rows)


def pingpong_ablation(tag: str = "_3d", dist: str = "pretrain", dps=(8, 16),
                      results_dir=None) -> pd.DataFrame:
    """The ping-pong ablation (the paper's Figure 11): per setting, the step of one stream (``cad``),
    of ping-pong and of the signal-only control, relative to ping-pong's."""
    s = summary(tag, results_dir)
    out = []
    for setting, g in s[s.setting.str.contains(f"_{dist}_") & s.dp.isin(dps)].groupby("setting", sort=False):
        st = g.set_index("method").step_s_mean
        out.append({"setting": setting, "dp": int(g.dp.iloc[0]),
                    "context_k": int(g.max_doc_len.iloc[0]) // 1024,
                    "one_stream_over_pingpong": st["cad"] / st["cad-pingpong"],
                    "signal_only_over_pingpong": st["signal-only"] / st["cad-pingpong"]})
    return pd.DataFrame(out)


def idle(results_dir=None) -> pd.DataFrame:
    """Idle over iteration time by DP degree at 512K-token chunks (the paper's Figure 4b): variable-length
    chunking, WLB's balanced packing and CAD, beside the paper's bars."""
    s = summary("_scenarios", results_dir)
    s = s[s.setting.str.startswith("idle_")]
    t = s.pivot(index="dp", columns="method", values="idle_fraction_mean") * 100
    t["paper"] = [DISTCA_FIG4B_IDLE.get(int(dp)) for dp in t.index]
    return t.reset_index()


def allgather(results_dir=None) -> pd.DataFrame:
    """Per-document CP's all-gather share of the step by number of nodes (the paper's Figure 3a)."""
    rows = []
    for n in DISTCA_FIG3_ALLGATHER:
        b = per_batch(f"allgather_{n}nodes", "_scenarios", results_dir)
        r = b[b.method == "wlb"]
        rows.append({"nodes": n, "share_pct": float((r.exposed_comm_s / r.step_s).mean() * 100),
                     "paper_pct": DISTCA_FIG3_ALLGATHER[n]})
    return pd.DataFrame(rows)


def record_claims(results_dir=None) -> pd.DataFrame:
    """Ours against every registry claim the scale replay covers (one row each)."""
    sp = speedups(PROTOCOL_TAG, results_dir=results_dir)
    lo, hi = int(sp.batches_timed.min()), int(sp.batches_timed.max())
    how_paper = HOW_PAPER.format(timed=how_timed(lo, hi, int(sp.batches.max())))
    out = []
    for d in ("pretrain", "prolong"):
        g = sp[sp.dist == d]
        out.append(claims.record(f"distca.speedup_3d_{d}", float(g.speedup_over_wlb.mean()), how=how_paper,
                                 note=f"Llama-8B only (the paper's 3D ranges pool 8B and 34B): mean of {len(g)} "
                                      f"settings (DP 8-32, 128K-512K), range {g.speedup_over_wlb.min():.3f}-"
                                      f"{g.speedup_over_wlb.max():.3f}x, standard errors "
                                      f"{g.speedup_over_wlb_sem.min():.3f}-{g.speedup_over_wlb_sem.max():.3f}"))
    idl = idle(results_dir).set_index("dp")
    for dp in (4, 8):
        out.append(claims.record(f"distca.idle_dp{dp}", float(idl.loc[dp, "varlen"]), how=HOW,
                                 setting="h200-replay",
                                 note="variable-length chunking of whole documents under the group's tokens"))
    ag = allgather(results_dir).set_index("nodes")
    for n in (2, 32):
        out.append(claims.record(f"distca.cp_allgather_{n}nodes", float(ag.loc[n, "share_pct"]), how=HOW,
                                 note="every document 32K tokens, 128K tokens per node, CP over all nodes"))
    p4 = speedups_4d_paper(results_dir=results_dir)
    for d in ("pretrain", "prolong"):
        g = p4[p4.dist == d]
        out.append(claims.record(
            f"distca.speedup_4d_8b_{d}", float(g.speedup_over_wlb.mean()), how=HOW_4D_PAPER,
            note=f"Llama-8B, mean of {len(g)} Table 4 settings, each method at its best configuration "
                 f"that the memory model fits in 140 GB (range {g.speedup_over_wlb.min():.3f}-"
                 f"{g.speedup_over_wlb.max():.3f}x; CAD at PP=1 throughout)",
            reason="the speedup is made by memory: where WLB-ideal does not fit without PP (512K tokens "
                   "per node) it runs PP=2 and CAD wins 1.10-1.28x; where it fits at PP=1 the two are "
                   "within 3%, and without a memory limit 0.99-1.03x"))
    ab = pingpong_ablation(results_dir=results_dir)
    gain = float((ab.one_stream_over_pingpong.mean() - 1) * 100)
    out.append(claims.record("distca.pingpong_gain", gain, how=HOW,
                             note="Pretrain on 8 and 16 nodes, 128K-512K: one stream over ping-pong",
                             reason="CAD's scheduler at tolerance 0.02 and TP's collectives taken as exposed"))
    exposed = float((1 / ab.signal_only_over_pingpong.mean() - 1) * 100)
    out.append(claims.record("distca.comm_hidden", exposed, how=HOW,
                             note="Pretrain on 8 and 16 nodes: ping-pong over the signal-only control"))
    return pd.concat(out, ignore_index=True)
