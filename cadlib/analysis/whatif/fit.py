"""What fits in the user's GPU memory: every configuration a user would choose, per method, against the
byte-level memory model (:mod:`cadlib.core.memory`, checked within 10% against every committed measured
peak in ``results/memory_model_check.json``).

A configuration of ``G`` GPUs is ``(TP, PP, CP, DP, m, recompute)`` with ``G = TP x PP x CP x DP``: TP
in the powers of two up to one node that divide the model's heads, KV heads, FFN and vocabulary; PP
dividing the layers; CP (only the methods that cut a sequence over ranks) and DP the rest; ``m``
micro-batches per DP replica; recompute ``none``, ``mlp`` or ``full``. A step of ``T`` tokens gives each
TP group ``n = T / (DP CP m)`` tokens per micro-batch, and a micro-batch holds whole documents: its
sequence (``CP n`` tokens for the CP methods, ``DP n`` for CAD's pool) must reach the context. Its
peak per GPU is :func:`cadlib.core.memory.estimate` of the method's rows, maximised over the pipeline
stages (:func:`cadlib.core.memory.fits`), under the ``profile`` (Megatron as DistCA runs it, by
default):

* colocated: per-document CP of degree 1 (each rank its own documents, no gathered K, V);
* WLB-ideal: per-document CP of degree ``CP`` (the gathered ``(CP - 1) n`` K, V rows);
* CAD with ping-pong: two nano-batches, attention servers over the DP ranks (no CP);
* CP ring (zigzag over the packed sequence, as Megatron, Transformer Engine and torchtitan run it):
  ``n`` rows of Q, K, V, O kept; its backward call holds the K, V block being used and the one
  arriving (``call_kv = 2 n``) and passes dK, dV around with them (``regather = 2 n``).

A configuration is ruled out for one reason, the first that applies: ``tp`` (TP does not divide the
model or exceeds a node), ``divide`` (TP x PP x CP does not divide the GPUs, PP the layers, or DP CP m the
step's tokens), ``context`` (a micro-batch shorter than the context), ``memory`` (the peak exceeds the
GPU). Of those that fit, each method's **chosen** one is the least recompute, then the fewest pipeline
stages, then the fewest micro-batches, then TP nearest the user's, then the least CP: a rule, not a
pricing of every candidate (the what-if prices TP/CP/DP configurations of one stage; PP configurations
are searched for memory only).
"""
from __future__ import annotations

from ...core.cost import as_model
from ...core.memory import GIB, MEGATRON, RECOMPUTE, Rows, estimate, method_rows

METHODS = ("colocated", "wlb", "cad-pingpong", "cp-ring")
"""The methods searched, in :mod:`cadlib.core.methods`' names (``cp-ring``: CP over the packed sequence)."""
REASONS = ("tp", "divide", "context", "memory")
"""Why a configuration was ruled out (module docstring), in the order they are checked."""
DEFAULT_GPU_MEM_GIB = 140.0
"""An H200 as DistCA counts it ("8x 140GB H200 GPUs", read as GiB: torch reports 140.4 GiB)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rows_of(method: str, n: int, cp: int, profile=MEGATRON) -> list[Rows]:
    """One micro-batch's rows on one GPU for ``method`` at ``n`` tokens per TP group and CP degree ``cp``."""
    if method == "colocated":
        return method_rows("wlb", n, 1, profile)
    if method == "wlb":
        return method_rows("wlb", n, cp, profile)
    if method == "cad-pingpong":
        return method_rows("cad", n, 1, profile, pingpong=True)
    if method == "cp-ring":
        return [Rows(n, call_kv=2 * n, regather=2 * n)]
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def peak(spec, method: str, n: int, *, tp: int, pp: int, cp: int, dp: int, n_micro: int, recompute: str,
         profile=MEGATRON) -> dict:
    """The highest stage's :func:`cadlib.core.memory.estimate` of one configuration (``stage`` added)."""
    rows = rows_of(method, n, cp, profile)
    sched = "lockstep" if method == "cad-pingpong" and pp > 1 else "1f1b"
    shard_cp = cp if method in ("wlb", "cp-ring") else 1
    best = None
    for st in range(pp):
        e = estimate(spec, rows, recompute=recompute, profile=profile, tp=tp, pp=pp, stage=st,
                     n_micro=n_micro, dp=dp, cp=shard_cp, schedule=sched)
        if best is None or e["peak"] > best["peak"]:
            best = {**e, "stage": st}
    return best


def search(model, gpus: int, gpus_per_node: int, step_tokens: int, context: int, *,
           gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB, tp_pref: int | None = None, max_micro: int = 16,
           recomputes=RECOMPUTE, methods=METHODS, profile=MEGATRON) -> dict:
    """Per method: ``tried``, ``ruled_out`` (counts by :data:`REASONS`), ``fitting`` (how many fit) and
    ``chosen`` (the module docstring's rule; None when nothing fits) with its ``peak_gib``."""
    spec = as_model(model)
    if not gpu_mem_gib > 0:
        raise ValueError(f"gpu_mem_gib must be > 0; got {gpu_mem_gib!r}")
    for name, v in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("step_tokens", step_tokens),
                    ("context", context), ("max_micro", max_micro)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
    cap = gpu_mem_gib * GIB
    tp_pref = tp_pref or gpus_per_node
    tps = [1 << i for i in range(gpus_per_node.bit_length()) if (1 << i) <= gpus_per_node]
    out = {}
    for method in methods:
        ruled = dict.fromkeys(REASONS, 0)
        ok = []
        tried = 0
        for tp in tps:
            for pp in _divisors(spec.n_layers):
                for cp in (_divisors(gpus) if method in ("wlb", "cp-ring") else [1]):
                    for m in range(1, max_micro + 1):
                        for rc in recomputes:
                            tried += 1
                            why, cfg = _check(spec, method, gpus, gpus_per_node, step_tokens, context, tp, pp,
                                              cp, m, rc, cap, profile)
                            if why:
                                ruled[why] += 1
                            else:
                                ok.append(cfg)
        chosen = min(ok, key=lambda c: (RECOMPUTE.index(c["recompute"]), c["pp"], c["n_micro"],
                                        abs(c["tp"] - tp_pref), c["cp"])) if ok else None
        out[method] = {"tried": tried, "fitting": len(ok), "ruled_out": ruled, "chosen": chosen}
    return {"gpu_mem_gib": gpu_mem_gib, "profile": profile.name, "step_tokens": step_tokens,
            "context": context, "gpus": gpus, "max_micro": max_micro, "methods": out}


def _check(spec, method, gpus, gpn, step_tokens, context, tp, pp, cp, m, rc, cap, profile):
    try:
        spec.shard(tp)
    except ValueError:
        return "tp", None
    if tp > gpn:
        return "tp", None
    if gpus % (tp * pp * cp) or spec.n_layers % pp:
        return "divide", None
    dp = gpus // (tp * pp * cp)
    n, r = divmod(step_tokens, dp * cp * m)
    if r or n < 1:
        return "divide", None
    if n * (dp if method == "cad-pingpong" else cp) < context:
        return "context", None
    if method == "cad-pingpong" and rc == "full" and not profile.stateful_servers:
        return "memory", None        # DistCA's ping-pong has no full recompute (stateless servers)
    e = peak(spec, method, n, tp=tp, pp=pp, cp=cp, dp=dp, n_micro=m, recompute=rc, profile=profile)
    cfg = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "n_micro": m, "recompute": rc, "tokens": n,
           "peak_gib": e["peak"] / GIB, "moment": e["moment"]}
    return ("memory", None) if e["peak"] > cap else (None, cfg)


LABELS = {"colocated": "Colocated", "wlb": "WLB-ideal", "cad-pingpong": "CAD (ping-pong)",
          "cp-ring": "CP ring (zigzag)"}


def text(res: dict) -> str:
    """The search in lines: per method its chosen configuration, memory per GPU and what ruled the others
    out."""
    words = {"tp": "TP not dividing the model or over a node", "divide": "not dividing the GPUs, layers or "
             "tokens", "context": "a micro-batch shorter than the context", "memory": "out of memory"}
    lines = [f"What fits in {res['gpu_mem_gib']:g} GiB per GPU ({res['profile']} memory profile; "
             f"--gpu-mem-gib, default {DEFAULT_GPU_MEM_GIB:g} for an H200): {res['step_tokens']:,} tokens a "
             f"step on {res['gpus']} GPUs, micro-batches up to {res['max_micro']}"]
    for m, r in res["methods"].items():
        c = r["chosen"]
        why = ", ".join(f"{r['ruled_out'][k]} {words[k]}" for k in REASONS if r["ruled_out"][k])
        if c is None:
            lines.append(f"  {LABELS[m]:<17} nothing fits of {r['tried']} tried ({why})")
            continue
        lines.append(f"  {LABELS[m]:<17} TP {c['tp']} PP {c['pp']} CP {c['cp']} DP {c['dp']}, {c['n_micro']} "
                     f"micro-batch{'es' if c['n_micro'] > 1 else ''} of {c['tokens']:,} tokens, recompute "
                     f"{c['recompute']}: {c['peak_gib']:.1f} GiB/GPU; {r['fitting']} of {r['tried']} fit "
                     f"(ruled out: {why or 'none'})")
    lines.append("  chosen: least recompute, fewest stages, fewest micro-batches, TP nearest yours, least CP "
                 "(a rule; PP configurations are searched for memory, not priced)")
    return "\n".join(lines)
