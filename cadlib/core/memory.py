"""Memory per GPU in bytes: what one training step holds at its peak, by named part and method.

A GPU's peak is the state present at a moment of the step plus the activations alive then plus that
moment's working set, maximised over four moments. Sizes are per GPU of a tensor-parallel group of
``t`` (:meth:`ModelSpec.shard`: ``q = Hq D / t``, ``kv = Hkv D / t``, ``f = ffn / t``, vocabulary
``V / t``; hidden-sized activations ``s = h / t`` under sequence parallelism, else ``h``), ``b = 2``
bytes (bf16), ``n`` the tokens of one (nano-)batch on the GPU (a TP group's tokens).

**State** of a pipeline stage of ``P`` parameters per GPU, bytes per parameter from the :class:`Profile`::

    weights P w    initial copy P c    grads P g    master + Adam moments P (m + o) / (DP CP if sharded)

**Saved per layer** (recompute ``none``; ``mlp``: the MLP keeps its input, ours ``--mlp-recompute``
and DistCA's ``recompute_modules=["mlp"]``; ``full``: the layer keeps its input)::

    linear  none: n (4 s b + 8 + 3 f b)     mlp: n (3 s b + 4)     full: n s b
    attn    q_rows q b + kv_rows 2 kv b + out_rows (q b + 4 Hq/t) + home_o q b     (0 under full)

with :class:`Rows`: colocated and WLB keep ``n`` rows of each (``kv_rows = n cp`` when per-document
CP keeps the gathered K, V: Megatron; ours re-gathers them in the backward); a stateful CAD server
(ours) keeps ``n + received Q`` query rows, ``n + received KV`` rows, O and LSE of its served rows,
and the home its own O when rows moved; stateless servers (DistCA, our pipeline ticks) keep nothing,
the home keeps ``q, k, v, o, lse`` of its own rows. Per micro-batch add ``misc = n (24 + 4 D)``
(token ids, targets, positions; RoPE's cos and sin). Stage ``s`` keeps ``k_s`` micro-batches: ``min(p - s,
m)`` under 1F1B, the largest count in flight of :func:`cadlib.core.pipeline.lockstep` for ticks.
``A = k_s (L_s saved + misc)``.

**Moments** (each adds the grads made so far: the head's and one layer's, all with a persistent
buffer; ``x`` the nano-batch whose backward runs, ``n_x`` its tokens)::

    mlp   last layer's MLP backward: A + N s b (dY of every nano-batch, N their tokens) + n_x ({mlp:
          s b + 4 + 5 f b | none: 2 f b | full: linear_none + attn + 2 f b}) + the SwiGLU's fp32 row
          blocks (ours, reference blocks: 6 blocks of min(n_x, 2^27 / f) f 4 bytes; fused: none);
          Megatron/TE: n_x (h b + 6 f b)
          (the input re-gathered under SP; fc1's output, its activation and their gradients)
    head  LM-head backward (last stage, one head per nano-batch, x's last): A + N (s b + 4) (final norms)
          + (N - n_x) h b (dH of the heads done) + (H - 1) V h b (their dW) + n_x (2 h b + 4) (input, lse,
          dH) + ours, chunked (c = min(chunk, n_x)): V h 4 (fp32 dW) + max(c V (4 + 2 b) [p, g, the
          previous chunk's g], c V b + V h 4 [g, the dW product]); Megatron: n_x (h b + V/t (b + 4))
          (bf16 logits, their fp32 copy turned into the softmax, then into its gradient in place)
    attn  last layer's attention backward: A + n q b (dO) + call rows: q (b + 4) + 8 Hq/t per query,
          2 kv (b + 4) per KV row (dQ, dK, dV, fp32 accumulators) + re-gathered (ours, per-document CP) or
          re-sent (stateless servers) KV rows 2 kv (b + 4) + re-sent query rows 3 q b + 4 Hq/t (Q, O, dO, LSE)
    opt   all-reduce and optimizer step: state + all grads + temporaries (ours: P 2, the all-reduce's flat
          bf16 bucket or the foreach step's sqrt of the second moment; sharded: P 4 / (DP CP))

Not modelled: the forward's working sets (CAD's send and receive buffers, the all-gather of
per-document CP), at most ``n (2 q + 2 kv) b`` beside less than all the activations, below the MLP
backward's ``n (2 s b + 5 f b)`` in every measured run; NCCL's own buffers (outside the caching
allocator's count). How it was checked: ``results/memory_model_check.json``
(``scripts/analyses/memory_check.py``) against every committed measured peak
(``torch.cuda.max_memory_allocated``, i.e. allocated bytes: no fragmentation factor is fitted; the
allocator's reserve is not counted, as the runs did not count it).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from .cost import ModelSpec, as_model
from .paper import DISTCA_GPU_MEMORY_GB
from .pipeline import lockstep, lockstep_orders, one_f_one_b

RECOMPUTE = ("none", "mlp", "full")
GIB = 2 ** 30
CAPACITY = DISTCA_GPU_MEMORY_GB * GIB
"""A DistCA GPU's memory in bytes: its "140GB" read as GiB (an H200 reports 140.4 GiB to torch)."""
SWIGLU_BWD_ELEMS = 1 << 27
"""Elements per fp32 row block of our SwiGLU backward (``cadlib.runtime.blocks.SWIGLU_BWD_ELEMS``)."""
SWIGLU_BWD_BLOCKS = 6
"""fp32 blocks alive at once in that loop (a, dY, sigmoid and three expression temporaries)."""


@dataclass(frozen=True)
class Profile:
    """How a training stack keeps its state and its activations. Bytes per parameter: ``weight``,
    ``init_copy`` (ours: the trainer keeps the initial weights to reset them between methods),
    ``grad``, ``master`` (fp32 copy), ``state`` (Adam's two moments), ``opt_tmp`` (the step's
    temporaries). ``shard_optimizer``: master, moments and ``opt_tmp`` over the DP x CP ranks
    (Megatron's distributed optimizer). ``grads_persist``: one grad buffer for the whole step
    (Megatron's ``main_grad``), else grads appear in the backward (ours, ``zero_grad(set_to_none)``).
    ``sequence_parallel``: TP shards the hidden-sized activations. ``fused_swiglu``: TE's SwiGLU
    backward (no fp32 row blocks; the input re-gathered under SP). ``swiglu_blocks``: our reference
    SwiGLU backward's fp32 row blocks (the fused kernel has none). ``head``: ``chunked`` (ours) or
    ``logits`` (Megatron's vocab-parallel cross-entropy). ``cp_keeps_kv``: per-document CP keeps
    the gathered K, V for the backward. ``stateful_servers``: CAD's servers keep their inputs.
    ``comm_buffer``: bytes of a fixed communication buffer (DistCA's NVSHMEM buffer)."""

    name: str
    weight: int = 2
    init_copy: int = 0
    grad: int = 2
    master: int = 0
    state: int = 4
    opt_tmp: int = 2
    shard_optimizer: bool = False
    grads_persist: bool = False
    sequence_parallel: bool = False
    fused_swiglu: bool = False
    swiglu_blocks: bool = True
    head: str = "chunked"
    cp_keeps_kv: bool = False
    stateful_servers: bool = True
    comm_buffer: int = 0


OURS = Profile("cadlib", weight=2, init_copy=2, grad=2, master=0, state=4, opt_tmp=2)
"""``cadlib.train``: bf16 weights, bf16 grads made in the backward, ``torch.optim.AdamW`` on the bf16
weights (its two moments bf16, no master copy; the foreach step's sqrt of the second moment is one
more bf16 copy), the initial weights kept on the GPU, chunked LM-head loss, K, V re-gathered; the
reference blocks (``cadlib.runtime.blocks``), as every committed run."""
OURS_FUSED = replace(OURS, name="cadlib-fused", swiglu_blocks=False)
"""``cadlib.train`` with the fused blocks (``cadlib.runtime.fused``, a GPU with triton): the same
activations (``Decoder.saved_bytes_per_token`` holds for both), no fp32 SwiGLU row blocks; the fused
head keeps ``dH`` and ``dW`` from its forward, within the chunked head's count."""
MEGATRON = Profile("megatron", weight=2, init_copy=0, grad=4, master=4, state=8, opt_tmp=4,
                   shard_optimizer=True, grads_persist=True, sequence_parallel=True, fused_swiglu=True,
                   head="logits", cp_keeps_kv=True, stateful_servers=False, comm_buffer=2 * GIB)
"""Megatron-LM as DistCA runs it (``distca/utils/megatron_test_utils.py``: ``use_distributed_optimizer=True``,
``grad_reduce_in_fp32=True``, bf16 params, ``sequence_parallel`` when TP > 1; the run scripts'
``EXPERIMENT_NVSHMEM_BUFFER_SIZE_GB=2``): fp32 main grads, fp32 master and moments sharded over DP x CP,
TE's fused kernels, vocab-parallel cross-entropy on fp32 logits, per-document CP keeping the gathered
K, V, stateless attention servers."""
PROFILES = {p.name: p for p in (OURS, OURS_FUSED, MEGATRON)}


@dataclass(frozen=True)
class Rows:
    """One (nano-)batch on one GPU. ``tokens``: rows of the linear layers; ``q``, ``kv``, ``out``:
    rows of Q, of K and V, of O and LSE that the attention keeps for the backward (default
    ``tokens``); ``home_o``: rows of a separate O the home keeps (CAD, rows returned); ``call_q``,
    ``call_kv``: query and KV rows of the backward kernel call (default ``out`` and ``kv``);
    ``regather``: KV rows re-gathered (ours, per-document CP) or re-sent (stateless servers) in the
    backward; ``resend_q``: query rows whose Q, O, dO and LSE a stateless server receives in it."""

    tokens: int
    q: int | None = None
    kv: int | None = None
    out: int | None = None
    home_o: int = 0
    call_q: int | None = None
    call_kv: int | None = None
    regather: int = 0
    resend_q: int = 0

    def __post_init__(self):
        for f in ("tokens", "q", "kv", "out", "home_o", "call_q", "call_kv", "regather", "resend_q"):
            v = getattr(self, f)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or int(v) != v or v < 0:
                raise ValueError(f"Rows.{f} must be an integer >= 0 (or None for its default); got {v!r}")
            object.__setattr__(self, f, int(v))
        for f, default in (("q", "tokens"), ("kv", "tokens"), ("out", "tokens"), ("call_q", "out"),
                           ("call_kv", "kv")):
            if getattr(self, f) is None:
                object.__setattr__(self, f, getattr(self, default))

    @classmethod
    def per_doc_cp(cls, tokens: int, gathered: int, profile) -> "Rows":
        """Per-document CP: ``gathered`` KV rows of other ranks' shards, kept for the backward
        (Megatron) or re-gathered in it (ours)."""
        if _profile(profile).cp_keeps_kv:
            return cls(tokens, kv=tokens + gathered)
        return cls(tokens, call_kv=tokens + gathered, regather=tokens + gathered)


def _check(name: str, value, lo: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}; got {value!r}")
    return int(value)


def _profile(profile) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    return PROFILES[profile]


def stage_params(spec: ModelSpec, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one GPU holds: ``L_s`` layers of ``h (q + 2 kv) + q h + 3 h f + 2 h``, the
    embedding ``V/t h`` on stage 0, the final norm ``h`` and the LM head ``V/t h`` on the last."""
    spec, tp, pp = as_model(spec), _check("tp", tp), _check("pp", pp)
    if not 0 <= stage < pp or spec.n_layers % pp:
        raise ValueError(f"stage must be in [0, pp={pp}) and pp divide the {spec.n_layers} layers; "
                         f"got stage={stage}")
    sh = spec.shard(tp)
    per_layer = sh.linear_params_per_layer() + 2 * sh.hidden
    p = per_layer * spec.n_layers // pp
    p += sh.vocab * sh.hidden if stage == 0 else 0
    return p + (sh.vocab * sh.hidden + sh.hidden if stage == pp - 1 else 0)


def layer_bytes(spec: ModelSpec, rows: Rows, recompute: str = "mlp", profile=OURS, tp: int = 1) -> dict:
    """Bytes one layer keeps for the backward of ``rows``: ``{"linear": ..., "attention": ...}``."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    pr, sh, b = _profile(profile), as_model(spec).shard(_check("tp", tp)), 2
    s = sh.hidden // tp if pr.sequence_parallel else sh.hidden
    n = rows.tokens
    if recompute == "full":
        return {"linear": n * s * b, "attention": 0}
    lin = n * (4 * s * b + 8 + 3 * sh.ffn * b) if recompute == "none" else n * (3 * s * b + 4)
    attn = (rows.q * sh.q_dim * b + rows.kv * 2 * sh.kv_dim * b + rows.out * (sh.q_dim * b + 4 * sh.n_heads)
            + rows.home_o * sh.q_dim * b)
    return {"linear": lin, "attention": attn}


@lru_cache(maxsize=None)
def in_flight(pp: int, n_micro: int, schedule: str = "1f1b") -> tuple[int, ...]:
    """Micro-batches whose activations stage ``s`` holds at once: ``min(pp - s, m)`` under 1F1B; the
    largest count between a forward and its backward under DistCA's lock-step ticks."""
    pp, n_micro = _check("pp", pp), _check("n_micro", n_micro)
    if schedule not in ("1f1b", "lockstep"):
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: 1f1b, lockstep")
    orders = one_f_one_b(pp, n_micro) if schedule == "1f1b" else lockstep_orders(lockstep(pp, n_micro))
    out = []
    for order in orders:
        live = peak = 0
        for op in order:
            if op.micro is not None:
                live += 1 if op.kind == "F" else -1
                peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def estimate(spec, nanos: Sequence[Rows], *, recompute: str = "mlp", profile=OURS, tp: int = 1,
             pp: int = 1, stage: int | None = None, n_micro: int = 1, dp: int = 1, cp: int = 1,
             ce_chunk: int = 8192, schedule: str = "1f1b") -> dict:
    """Bytes of one GPU at its peak, by named part: ``weights``, ``init_copy``, ``optimizer``,
    ``comm_buffer``, ``grads``, ``activations`` (saved, micro-batches in flight), ``working_set``;
    ``peak`` their sum, ``moment`` the moment that sets it, ``moments`` every moment's total.
    ``nanos``: the (nano-)batches of one micro-batch on this GPU (two under ping-pong). ``stage``
    defaults to the last (the LM head's) for ``pp = 1`` and to 0 (most in flight) otherwise."""
    spec, pr = as_model(spec), _profile(profile)
    tp, dp, cp, ce_chunk = _check("tp", tp), _check("dp", dp), _check("cp", cp), _check("ce_chunk", ce_chunk)
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    if not nanos or not all(isinstance(r, Rows) for r in nanos):
        raise ValueError("nanos must be a non-empty sequence of Rows (one per nano-batch)")
    stage = (pp - 1 if pp == 1 else 0) if stage is None else stage
    params = stage_params(spec, tp, pp, stage)
    sh, b, last = spec.shard(tp), 2, stage == pp - 1
    s, f, L = (sh.hidden // tp if pr.sequence_parallel else sh.hidden), sh.ffn, spec.n_layers // pp
    k = in_flight(pp, n_micro, schedule)[stage]
    shard = dp * cp if pr.shard_optimizer else 1
    head_p = sh.vocab * sh.hidden + sh.hidden if last else 0
    layer_p = (params - head_p - (sh.vocab * sh.hidden if stage == 0 else 0)) // L
    state = {"weights": params * pr.weight, "init_copy": params * pr.init_copy,
             "optimizer": params * (pr.master + pr.state) // shard, "comm_buffer": pr.comm_buffer}
    per = [layer_bytes(spec, r, recompute, pr, tp) for r in nanos]
    misc = sum(r.tokens for r in nanos) * (24 + 4 * sh.head_dim)
    acts = k * (L * sum(p["linear"] + p["attention"] for p in per) + misc)
    tot = sum(r.tokens for r in nanos)

    def grads(made: int) -> int:              # grads present: all with a persistent buffer
        return params * pr.grad if pr.grads_persist else made * pr.grad

    def mlp(r: Rows) -> int:                  # the last layer's MLP backward of nano-batch r
        n = r.tokens
        if recompute == "full":               # the whole layer recomputed first, then as "none"
            keep, extra = sum(layer_bytes(spec, r, "none", pr, tp).values()), 2 * f * b
        else:
            keep, extra = 0, {"mlp": s * b + 4 + 5 * f * b, "none": 2 * f * b}[recompute]
        if pr.fused_swiglu:                   # TE: input re-gathered (SP), no fp32 blocks
            extra, blocks = sh.hidden * b + (6 if recompute == "mlp" else 3) * f * b, 0
        else:
            blocks = SWIGLU_BWD_BLOCKS * min(n, SWIGLU_BWD_ELEMS // f) * f * 4 if n else 0
            blocks = blocks if pr.swiglu_blocks else 0
        return keep + n * (s * b + extra) + blocks + (tot - n) * s * b     # + the others' pending dY

    def attn(r: Rows) -> int:                 # the last layer's attention backward
        kv_b = 2 * sh.kv_dim * (b + 4)
        return (r.tokens * sh.q_dim * b + r.call_q * (sh.q_dim * (b + 4) + 8 * sh.n_heads)
                + (r.call_kv + r.regather) * kv_b + r.resend_q * (3 * sh.q_dim * b + 4 * sh.n_heads))

    moments = {"mlp": (acts, grads(head_p + sh.hidden * f), max(map(mlp, nanos))),
               "attn": (acts, grads(head_p + layer_p), max(map(attn, nanos)))}
    if last:                                  # one head per nano-batch; x's backward runs last
        hb, vh = sh.hidden * b, sh.vocab * sh.hidden

        def head(r: Rows) -> int:
            n, c = r.tokens, min(ce_chunk, r.tokens)
            if pr.head != "chunked":          # bf16 logits and their fp32 copy (softmax, then its gradient)
                return tot * (s * b + 4) + n * (hb + sh.vocab * (b + 4))
            chunks = c * sh.vocab * (4 + b * (2 if n > c else 1))   # p, g and the last chunk's g
            return (tot * (s * b + 4) + (tot - n) * hb + n * (2 * hb + 4) + (len(nanos) - 1) * vh * b
                    + 4 * vh + max(chunks, c * sh.vocab * b + 4 * vh))
        moments["head"] = (acts, grads(0), max(map(head, nanos)))
    moments["opt"] = (0, params * pr.grad, params * pr.opt_tmp // shard)
    base = sum(state.values())
    totals = {m: base + sum(v) for m, v in moments.items()}
    moment = max(totals, key=totals.get)
    a, g, w = moments[moment]
    return {**state, "grads": g, "activations": a, "working_set": w, "peak": totals[moment],
            "moment": moment, "moments": totals, "in_flight": k, "params": params}


# ---------------------------------------------------------------------------------------------------
# What fits: the tokens a baseline fits, and the 4D configurations of both methods that fit
# ---------------------------------------------------------------------------------------------------

METHODS = ("wlb", "cad")
"""What the fit studies compare, named as in :mod:`cadlib.core.methods`: WLB-ideal's per-document CP
and CAD (with or without ping-pong, :func:`method_rows`' ``pingpong``)."""


def method_rows(method: str, tokens: int, cp: int = 1, profile=MEGATRON, pingpong: bool = True,
                call_kv: float = 2.0) -> list[Rows]:
    """One micro-batch's rows on a GPU whose TP group holds ``tokens`` (a CP rank's share).
    ``wlb``: per-document CP over ``cp`` ranks, every document cut over all of them (its all-gather
    brings the other ``(cp - 1) tokens`` rows: the worst case, and the case of a micro-batch of
    documents as long as the CP group's tokens). ``cad``: a server's call reads ``call_kv`` KV rows per
    query row (an assumption: a shard's KV prefix; 2 for shards of documents spread evenly) for its
    (balanced) ``tokens`` query rows; stateful servers (:data:`OURS`) keep them and the home its O,
    stateless ones (DistCA) keep nothing (the homes keep their rows) and receive them again in the
    backward with Q, O, dO and LSE; two nano-batches under ping-pong."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    tokens, cp = _check("tokens", tokens), _check("cp", cp)
    if method == "wlb":
        return [Rows.per_doc_cp(tokens, (cp - 1) * tokens, profile)]
    parts = [tokens // 2, tokens - tokens // 2] if pingpong else [tokens]
    if _profile(profile).stateful_servers:
        return [Rows(n, kv=int(call_kv * n), home_o=n) for n in parts]
    return [Rows(n, call_kv=int(call_kv * n), regather=int(call_kv * n), resend_q=n) for n in parts]


def fits(spec, method: str, tokens: int, *, capacity: float = CAPACITY, **kw) -> dict:
    """:func:`estimate` of ``method`` (``tp``, ``pp``, ``cp``, ``dp``, ``n_micro``, ``recompute``,
    ``profile``, ``schedule``, ``ce_chunk`` as keywords) at ``tokens`` per TP group and micro-batch,
    with ``fits``: its peak at most ``capacity`` bytes. CAD runs without CP and, under PP, in
    DistCA's lock-step ticks."""
    pr = _profile(kw.pop("profile", MEGATRON))
    cp = kw.pop("cp", 1)
    if method == "cad":
        kw.setdefault("schedule", "lockstep")
    rows = method_rows(method, tokens, cp, pr)
    e = estimate(spec, rows, profile=pr, cp=cp if method == "wlb" else 1, **kw)
    return {**e, "fits": e["peak"] <= capacity}


def max_tokens(spec, method: str = "wlb", *, capacity: float = CAPACITY, step: int = 1024,
               limit: int = 1 << 26, **kw) -> int:
    """The most tokens per TP group and micro-batch (a multiple of ``step``) at which ``method`` fits
    in ``capacity`` bytes on every pipeline stage ("the baseline just fits"; the paper's tokens per
    node with TP = 8 and one micro-batch); 0 when even ``step`` does not fit."""
    step, pp = _check("step", step), kw.get("pp", 1)

    def ok(n: int) -> bool:
        return all(fits(spec, method, n, capacity=capacity, stage=s, **kw)["fits"] for s in range(pp))
    if not ok(step):
        return 0
    lo, hi = 1, max(2, limit // step)                 # ok(lo * step), not ok(hi * step) or hi at limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * step) else (lo, mid)
    return lo * step


def configs(spec, gpus: int, tokens: int, *, methods=METHODS, tps=(8,), recomputes=("mlp", "full"),
            max_micro: int = 64, max_doc_len: int = 1, capacity: float = CAPACITY,
            profile=MEGATRON) -> list[dict]:
    """Every 4D configuration of ``gpus`` GPUs for a step of ``tokens`` tokens, for each method:
    ``tp`` in ``tps``, ``pp`` dividing the layers, ``cp`` (WLB only), ``dp``, ``n_micro`` up to
    ``max_micro`` micro-batches per DP replica, ``recompute`` in ``recomputes`` (DistCA's ping-pong has
    no full recompute); the micro-batch's tokens per TP group (``tokens / (dp cp n_micro)``; a
    micro-batch holds whole documents: WLB's CP group, ``cp n``, or CAD's DP ranks, ``dp n``, at least
    ``max_doc_len`` tokens), the peak over the stages, whether it ``fits`` in ``capacity`` and what
    sets that peak (``moment``, ``activations``, ``working_set`` of the stage with the highest)."""
    spec, gpus, tokens = as_model(spec), _check("gpus", gpus), _check("tokens", tokens)
    pr, out = _profile(profile), []
    for method in methods:
        for tp in tps:
            pps = [p for p in range(1, gpus // tp + 1) if spec.n_layers % p == 0 and gpus % (tp * p) == 0]
            for pp in pps:
                rest = gpus // (tp * pp)
                for cp in ((c for c in range(1, rest + 1) if rest % c == 0) if method == "wlb" else (1,)):
                    dp = rest // cp
                    for m in range(1, max_micro + 1):
                        n, r = divmod(tokens, dp * cp * m)
                        if r or n < 1 or n * (cp if method == "wlb" else dp) < max_doc_len:
                            continue
                        for rc in recomputes:
                            if method == "cad" and rc == "full" and not pr.stateful_servers:
                                continue
                            kw = dict(tp=tp, pp=pp, cp=cp, dp=dp, n_micro=m, recompute=rc)
                            top = max((fits(spec, method, n, capacity=capacity, stage=s, profile=pr, **kw)
                                       for s in range(pp)), key=lambda e: e["peak"])
                            out.append({"method": method, **kw, "profile": pr.name, "tokens": n,
                                        "peak": top["peak"], "fits": top["fits"], "moment": top["moment"],
                                        "activations": top["activations"], "working_set": top["working_set"]})
    return out
