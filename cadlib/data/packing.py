"""Packing documents into the **linear layout**: which rank holds which tokens for the linear layers.

* ``sequential`` fills rank 0, then rank 1, ... and cuts a document that crosses a rank boundary into
  head/tail chunks (every rank holds exactly ``tokens_per_rank`` tokens), as DistCA does.
* ``balanced`` is WLB-LLM-style variable-length packing that evens out the estimated cost per rank
  under a token cap.
* :func:`per_doc_zigzag_layout` is per-document context parallelism's layout: every document in ``2R``
  pieces, rank ``r`` holding a head and a tail;
* :func:`wlb_layout` is WLB-ideal's (ours: ``balanced`` replicas, every chunk in ``2 cp`` pieces) and
  :func:`wlb_distca_layout` WLB-LLM's as DistCA runs it (whole documents to replicas,
  :func:`wlb_distca_buckets`; every document in ``2 cp`` shards, :func:`per_doc_cp_layout`);
* :func:`rank_costs` gives each rank's linear and attention load when every chunk runs where it lives.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np

from ..core.cost import ModelSpec, as_model, causal_pairs
from ..core.layout import Chunk, Layout
from ..core.paper import DISTCA_WLB_BREAKPOINT, DISTCA_WLB_BREAKPOINT_DEFAULT, DISTCA_WLB_EMPTY_PAD

PACK_METHODS: tuple[str, ...] = ("sequential", "balanced", "distca")
DEFAULT_CAP_FACTOR = 1.25
"""``balanced`` packing lets a rank hold up to this many times ``tokens_per_rank`` tokens."""
PIECE_COST_FRACTION = 0.5
"""``balanced`` packing cuts a document costing more than this fraction of the mean rank cost into
equal-cost pieces: no placement of a whole document can bring a rank's cost below the document's own.
Half (not one) leaves LPT room to pair pieces; on 120 sampled batches (6 settings x 20 seeds) it
lowered max/mean attention FLOPs vs sequential by 35% on average and never raised total-FLOP max/mean."""

# ---------------------------------------------------------------------------------------------------
# Packing into the linear layout
# ---------------------------------------------------------------------------------------------------

def _check_docs(doc_lens: Sequence[int]) -> list[int]:
    lens = [int(n) for n in doc_lens]
    if not lens:
        raise ValueError("doc_lens is empty; pack needs at least one document")
    for i, (n, raw) in enumerate(zip(lens, doc_lens)):
        if n < 1 or n != raw:
            raise ValueError(f"document {i} has length {raw!r}; document lengths must be integers >= 1")
    return lens


def _check_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 1 (Python or numpy), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def pack(doc_lens: Sequence[int], n_ranks: int, tokens_per_rank: int | None = None,
         method: str = "sequential", model: ModelSpec | str | None = None,
         cap: int | None = None) -> Layout:
    """Place documents on ``n_ranks`` ranks for the linear layers; returns a validated ``Layout``.

    ``sequential``: documents in order fill rank 0, then rank 1, ...; a document crossing a rank
    boundary is cut into chunks, so every rank holds exactly ``tokens_per_rank`` tokens (default
    ``sum(doc_lens) / n_ranks``, which must be whole; ``sum(doc_lens) == n_ranks * tokens_per_rank``).

    ``distca``: the same order and token counts, as DistCA places a nano-batch's documents
    (``batch_to_items_general``): a document that fits in what is left of a rank stays whole; one
    that does not gives each rank it reaches a head and a tail, ``c // 2`` tokens from its front and
    ``c - c // 2`` from its back for a share of ``c`` tokens, so the document's middle lands last.

    ``balanced`` (WLB-LLM var-len packing): documents, costliest (= longest) first, go to the rank with
    the lowest estimated cost ``attention_flops(pairs) + linear_flops_per_token * tokens`` (fwd+bwd,
    all layers of ``model``, default llama3-8b) among ranks with room for the whole document, under a
    token cap per rank (default ``floor(1.25 * tokens_per_rank)``, ``tokens_per_rank`` defaulting to
    ``ceil(sum / n_ranks)``). A document costing more than ``PIECE_COST_FRACTION`` of the mean rank
    cost is first cut into consecutive equal-cost pieces (head/tail chunks), placed like documents.
    A piece that fits nowhere whole is cut again: its next chunk fills the rank with the most room
    (ties: lowest cost), and so on until nothing is left. Ranks hold between 0 and ``cap`` tokens.
    """
    lens = _check_docs(doc_lens)
    n_ranks = _check_int("n_ranks", n_ranks)
    if method not in PACK_METHODS:
        raise ValueError(f"unknown pack method {method!r}; choose one of: {', '.join(PACK_METHODS)}")
    if tokens_per_rank is not None:
        tokens_per_rank = _check_int("tokens_per_rank", tokens_per_rank)
    if cap is not None:
        cap = _check_int("cap", cap)
    n_ranks, total = int(n_ranks), sum(lens)
    if method in ("sequential", "distca"):
        if cap is not None:
            raise ValueError("cap applies only to method 'balanced'; sequential ranks hold exactly "
                             "tokens_per_rank tokens")
        if tokens_per_rank is None:
            if total % n_ranks:
                raise ValueError(f"{total} tokens do not split evenly over {n_ranks} ranks; pass "
                                 "tokens_per_rank, or documents whose total is a multiple of n_ranks")
            tokens_per_rank = total // n_ranks
        if total != n_ranks * tokens_per_rank:
            raise ValueError(f"sequential packing needs sum(doc_lens) == n_ranks * tokens_per_rank; got "
                             f"{total} != {n_ranks} * {tokens_per_rank}")
        if method == "distca":
            return _pack_distca(lens, n_ranks, int(tokens_per_rank))
        return _pack_sequential(lens, n_ranks, int(tokens_per_rank))
    if tokens_per_rank is None:
        tokens_per_rank = -(-total // n_ranks)
    if cap is None:
        cap = int(DEFAULT_CAP_FACTOR * tokens_per_rank)
    if cap < tokens_per_rank:
        raise ValueError(f"cap ({cap}) must be >= tokens_per_rank ({tokens_per_rank})")
    if total > n_ranks * cap:
        raise ValueError(f"{total} tokens do not fit on {n_ranks} ranks of at most cap={cap} tokens; "
                         "raise cap or tokens_per_rank")
    return _pack_balanced(lens, n_ranks, int(cap), as_model(model))


def _pack_sequential(lens: list[int], n_ranks: int, tokens_per_rank: int) -> Layout:
    """Cut the concatenated token stream at multiples of ``tokens_per_rank``."""
    ranks: list[list[Chunk]] = [[] for _ in range(n_ranks)]
    rank, room = 0, tokens_per_rank
    for d, n in enumerate(lens):
        pos = 0
        while pos < n:
            take = min(n - pos, room)
            ranks[rank].append(Chunk(d, pos, pos + take))
            pos += take
            room -= take
            if room == 0 and rank + 1 < n_ranks:
                rank, room = rank + 1, tokens_per_rank
    return Layout(ranks, lens)


def _pack_distca(lens: list[int], n_ranks: int, tokens_per_rank: int) -> Layout:
    """Sequential filling; a document that crosses a rank boundary is dealt out head and tail: a share
    of ``c`` tokens takes ``[h, h + c // 2)`` and ``[t - (c - c // 2), t)``, with ``h`` (``t``) the
    first (one past the last) position not yet placed."""
    ranks: list[list[Chunk]] = [[] for _ in range(n_ranks)]
    rank, room = 0, tokens_per_rank
    for d, n in enumerate(lens):
        if n <= room:
            ranks[rank].append(Chunk(d, 0, n))
            room -= n
        else:
            head, tail, left = 0, n, n
            while left:
                c = min(left, room)
                h, tl = c // 2, c - c // 2
                if h:
                    ranks[rank].append(Chunk(d, head, head + h))
                if tl:
                    ranks[rank].append(Chunk(d, tail - tl, tail))
                head, tail, left, room = head + h, tail - tl, left - c, room - c
                if room == 0 and rank + 1 < n_ranks:
                    rank, room = rank + 1, tokens_per_rank
            continue
        if room == 0 and rank + 1 < n_ranks:
            rank, room = rank + 1, tokens_per_rank
    return Layout(ranks, lens)


def _pieces_by_cost(lens: list[int], n_ranks: int, a: float, b: float) -> list[tuple[float, int, int, int]]:
    """Cut every document costing more than ``target = PIECE_COST_FRACTION * sum C(n_d) / n_ranks``
    (half the mean rank cost) into ``k = ceil(C(n) / target)`` consecutive pieces of equal cost,
    where the cost of tokens ``[0, e)`` is ``C(e) = a e(e+1)/2 + b e`` (``a``: FLOPs per attention
    pair, ``b``: linear FLOPs per token), and the ``j``-th cut is ``C^-1(c), c = j C(n) / k``, with
    ``C^-1(c) = 2c / (h + sqrt(h^2 + 2ac))``, ``h = a/2 + b``.
    Returns ``(cost, doc, start, end)`` per piece."""
    def cum(e):
        return a * causal_pairs(0, e) + b * e

    target = PIECE_COST_FRACTION * sum(cum(n) for n in lens) / n_ranks
    h = a / 2 + b
    out = []
    for d, n in enumerate(lens):
        k = max(1, math.ceil(cum(n) / target - 1e-9))
        cuts = {min(n - 1, max(1, round(2 * c / (h + math.sqrt(h * h + 2 * a * c)))))
                for c in (j * cum(n) / k for j in range(1, k))}
        bounds = [0, *sorted(cuts), n] if n > 1 else [0, n]
        out += [(cum(e) - cum(s), d, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    return out


def _pack_balanced(lens: list[int], n_ranks: int, cap: int, model: ModelSpec) -> Layout:
    """Longest-cost-first greedy assignment to the cheapest rank with room (see ``pack``).

    Cost of a piece ``[s, e)``: ``attention_flops(pairs(s, e)) + linear_flops_per_token * (e - s)``,
    fwd+bwd over all layers. Causal pairs add up over consecutive pieces, so cutting a document moves
    its attention work between ranks without changing the total."""
    a = float(model.attention_flops(1, backward=True))
    b = model.linear_flops_per_token(backward=True)
    ranks: list[list[Chunk]] = [[] for _ in range(n_ranks)]
    tokens = np.zeros(n_ranks, dtype=np.int64)
    cost = np.zeros(n_ranks, dtype=np.float64)
    for _, d, pos, end in sorted(_pieces_by_cost(lens, n_ranks, a, b), key=lambda p: (-p[0], p[1], p[2])):
        while pos < end:
            room = cap - tokens
            fits = room >= end - pos
            if fits.any():
                r = int(np.argmin(np.where(fits, cost, np.inf)))
            else:
                r = int(np.lexsort((cost, -room))[0])         # most room, then lowest cost
            take = int(min(end - pos, room[r]))
            ranks[r].append(Chunk(d, pos, pos + take))
            cost[r] += a * causal_pairs(pos, pos + take) + b * take
            tokens[r] += take
            pos += take
    return Layout([_merge(r) for r in ranks], lens)


def _merge(chunks: list[Chunk]) -> list[Chunk]:
    """Sort a rank's chunks and join neighbours of one document (``[s, e)`` + ``[e, f)`` = ``[s, f)``)."""
    out: list[Chunk] = []
    for c in sorted(chunks):
        if out and out[-1].doc == c.doc and out[-1].end == c.start:
            out[-1] = Chunk(c.doc, out[-1].start, c.end)
        else:
            out.append(c)
    return out


def per_doc_zigzag_layout(doc_lens: Sequence[int], n_ranks: int) -> Layout:
    """Per-document CP layout: each document cut into ``2R`` near-equal pieces (integer bounds
    ``n*k // 2R``); rank ``r`` holds piece ``r`` (head) and piece ``2R-1-r`` (tail), so causal work
    is balanced. Empty pieces of documents shorter than ``2R`` are dropped."""
    if int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks}")
    R = int(n_ranks)
    n = np.asarray([int(x) for x in doc_lens], dtype=np.int64)
    piece = np.stack([np.arange(R), 2 * R - 1 - np.arange(R)], axis=1)[:, None, :]    # [R, 1, 2]
    start, end = n[None, :, None] * piece // (2 * R), n[None, :, None] * (piece + 1) // (2 * R)
    shape = (R, n.size, 2)                                  # rank-major, then document, head before tail
    rows = np.stack([np.broadcast_to(np.arange(n.size)[None, :, None], shape), start, end,
                     np.broadcast_to(np.arange(R)[:, None, None], shape)], axis=-1).reshape(-1, 4)
    rows = rows[rows[:, 2] > rows[:, 1]]
    rows.flags.writeable = False                            # handed over, not copied
    return Layout.from_chunks(rows, n.tolist(), R)


def per_doc_gather_tokens(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Per-document context parallelism's all-gather, per rank, in tokens: ``(sent, received)``. A
    document held by several ranks (``H_d`` of them) has its K, V gathered by every holder: rank ``r``
    receives the tokens of ``d`` it does not hold, ``len_d - own_{r,d}``, and sends its own
    ``own_{r,d}`` to the ``|H_d| - 1`` others. Documents held by one rank move nothing."""
    ch = layout.chunk_array()
    R = layout.n_ranks
    if not ch.shape[0]:
        return np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
    key = ch[:, 0] * R + ch[:, 3]
    uk, inv = np.unique(key, return_inverse=True)
    own = np.bincount(inv, weights=ch[:, 2] - ch[:, 1]).astype(np.int64)
    doc, rank = uk // R, uk % R
    holders = np.bincount(doc, minlength=layout.n_docs)[doc]
    shared = holders > 1
    lens = np.asarray(layout.doc_lens, dtype=np.int64)[doc]
    recv = np.bincount(rank[shared], weights=(lens - own)[shared], minlength=R).astype(np.int64)
    sent = np.bincount(rank[shared], weights=(own * (holders - 1))[shared], minlength=R).astype(np.int64)
    return sent, recv


def wlb_layout(doc_lens: Sequence[int], n_ranks: int, cp: int, tokens_per_rank: int,
               model: ModelSpec | str | None = None) -> Layout:
    """WLB-LLM's layout with context parallelism of degree ``cp``: the documents balanced over
    ``n_ranks / cp`` replicas (:func:`pack`, ``balanced``, ``cp * tokens_per_rank`` tokens each), then
    every chunk of a replica cut into ``2 cp`` pieces shared by its ``cp`` ranks head and tail (rank
    ``i`` of the group holds pieces ``i`` and ``2 cp - 1 - i``: equal causal work). ``cp = 1`` is the
    balanced packing itself."""
    n_ranks, cp = _check_int("n_ranks", n_ranks), _check_int("cp", cp)
    if n_ranks % cp:
        raise ValueError(f"cp={cp} must divide n_ranks={n_ranks}")
    lens = _check_docs(doc_lens)
    rep = pack(lens, n_ranks // cp, cp * int(tokens_per_rank), method="balanced", model=model)
    if cp == 1:
        return rep
    ch = rep.chunk_array()
    n = ch[:, 2] - ch[:, 1]
    piece = np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], axis=1)[None]      # [1, cp, 2]
    start = ch[:, 1, None, None] + n[:, None, None] * piece // (2 * cp)
    end = ch[:, 1, None, None] + n[:, None, None] * (piece + 1) // (2 * cp)
    shape = (ch.shape[0], cp, 2)
    rank = ch[:, 3, None, None] * cp + np.arange(cp)[None, :, None]
    rows = np.stack([np.broadcast_to(ch[:, 0, None, None], shape), start, end,
                     np.broadcast_to(rank, shape)], axis=-1).reshape(-1, 4)
    return Layout.from_chunks(rows[rows[:, 2] > rows[:, 1]], lens, n_ranks)


def wlb_breakpoint(model: ModelSpec | str | None = None) -> int:
    """WLB-LLM's ``ATTN_LINEAR_BREAKPOINT`` for ``model`` (a tensor-parallel shard counts as its model):
    ``DISTCA_WLB_BREAKPOINT``, else the code's default ``DISTCA_WLB_BREAKPOINT_DEFAULT``."""
    return DISTCA_WLB_BREAKPOINT.get(as_model(model).name.split("/")[0], DISTCA_WLB_BREAKPOINT_DEFAULT)


def wlb_distca_buckets(doc_lens: Sequence[int], n_buckets: int, cap: int | None = None,
                       model: ModelSpec | str | None = None) -> tuple[list[list[int]], list[int]]:
    """WLB-LLM's variable-length packing as DistCA runs it (``balance_data_for_wlbllm``,
    ``distca/planner/wlb_planner.py:36-126``, without deferred execution): whole documents to
    ``n_buckets`` buckets (replicas). With ``x = l / Bk`` (``Bk``: :func:`wlb_breakpoint`) a bucket's
    workload is ``W = sum (x^2 + x)`` over its documents (L13-25) and ``Lmax = cap`` (default: the
    total over ``n_buckets``, floored, L73):

    1. documents longest first (L76-77); each goes to the bucket of least ``W`` if its tokens stay
       ``<= Lmax``, else to the bucket of fewest tokens if they stay ``<= Lmax``, else is deferred
       (L84-97; ties: the first bucket);
    2. deferred documents, in order, to the bucket of least ``W`` with no cap (L100-104);
    3. a bucket left empty gets a dummy document of ``DISTCA_WLB_EMPTY_PAD`` (128) tokens (L109-113).

    One bucket holds every document in the given order (L121-124). Returns ``(buckets, lens)``:
    per bucket the indices of its documents in placement order, into ``lens`` = ``doc_lens`` followed
    by the dummies (a replica runs a dummy like any document, as DistCA's does). DistCA's 4D driver
    passes ``n_buckets = dp x micro-batches`` with the 3D ``Lmax`` (``tests/test_wlb_e2e.py:517-523``),
    i.e. ``cap`` = the mean over ``micro-batches``: step 1 then places little and step 2 most."""
    lens = _check_docs(doc_lens)
    n = _check_int("n_buckets", n_buckets)
    if n == 1:
        return [list(range(len(lens)))], list(lens)
    cap = sum(lens) // n if cap is None else _check_int("cap", cap)
    bk = float(wlb_breakpoint(model))
    buckets: list[list[int]] = [[] for _ in range(n)]
    work, size = [0.0] * n, [0] * n

    def put(r: int, d: int) -> None:
        x = lens[d] / bk
        buckets[r].append(d)
        work[r] += x ** 2 + x                  # summed in placement order, as DistCA's sum() is
        size[r] += lens[d]

    deferred = []
    for d in sorted(range(len(lens)), key=lambda d: -lens[d]):
        least_work = min(range(n), key=work.__getitem__)
        fewest = min(range(n), key=size.__getitem__)
        if size[least_work] + lens[d] <= cap:
            put(least_work, d)
        elif size[fewest] + lens[d] <= cap:
            put(fewest, d)
        else:
            deferred.append(d)
    for d in deferred:
        put(min(range(n), key=work.__getitem__), d)
    out = list(lens)
    for b in buckets:
        if not b:
            b.append(len(out))
            out.append(DISTCA_WLB_EMPTY_PAD)
    return buckets, out


def per_doc_cp_layout(buckets: Sequence[Sequence[int]], doc_lens: Sequence[int], cp: int) -> Layout:
    """Per-document CP as WLB-LLM's code shards it (``compute_per_doc_cp_shard_doc_len``,
    ``baseline/wlbllm_original/wlbllm/utils.py:29-78``): bucket ``j`` (documents by index into
    ``doc_lens``) runs on ranks ``j cp ... j cp + cp - 1``; every one of its documents, however
    short, is cut into ``K = 2 cp`` consecutive shards of ``l // K`` tokens, its ``l mod K``
    remaining tokens dealt one each to shards ``c, c + 1, ...`` (mod ``K``), ``c`` a counter that
    runs on over the bucket's documents; rank ``g`` of the group holds shards ``g`` and ``K - 1 - g``
    (its local order: shard ``g`` of every document, then shard ``K - 1 - g``; empty shards dropped).
    Ranks hold the same tokens to within one per document."""
    cp = _check_int("cp", cp)
    lens = np.asarray(_check_docs(doc_lens), dtype=np.int64)
    K = 2 * cp
    rows = []
    for j, bucket in enumerate(buckets):
        docs = np.asarray(bucket, dtype=np.int64)
        n = lens[docs]
        rem = n % K
        first = (np.cumsum(rem) - rem) % K                  # the counter where each remainder starts
        size = n[:, None] // K + (((np.arange(K)[None, :] - first[:, None]) % K) < rem[:, None])
        end = np.cumsum(size, axis=1)
        for g in range(cp):
            for i in (g, K - 1 - g):
                rows.append(np.stack([docs, end[:, i] - size[:, i], end[:, i],
                                      np.full(docs.size, j * cp + g)], axis=1))
    rows = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64)
    return Layout.from_chunks(rows[rows[:, 2] > rows[:, 1]], lens.tolist(), len(buckets) * cp)


def wlb_distca_layout(doc_lens: Sequence[int], n_ranks: int, cp: int, tokens_per_rank: int | None = None,
                      model: ModelSpec | str | None = None, cap: int | None = None) -> Layout:
    """WLB-ideal as DistCA's 3D driver runs WLB-LLM (``tests/test_e2e_combined.py:857-927``): the
    documents whole over ``n_ranks / cp`` replicas (:func:`wlb_distca_buckets`, ``Lmax`` = ``cap``,
    default ``cp x tokens_per_rank``, the replica's share, or the mean when ``tokens_per_rank`` is
    None), then per-document CP of degree ``cp`` in each (:func:`per_doc_cp_layout`), replica-major
    like :func:`wlb_layout`. A replica's dummy document (its bucket was empty) is a document of the
    layout after ``doc_lens``'. Not modelled: the driver's padding of a replica's documents to the DP
    size with 512-token ones and of its total to a multiple of ``16 cp`` (L883-893)."""
    n_ranks, cp = _check_int("n_ranks", n_ranks), _check_int("cp", cp)
    if n_ranks % cp:
        raise ValueError(f"cp={cp} must divide n_ranks={n_ranks}")
    if cap is None and tokens_per_rank is not None:
        cap = cp * _check_int("tokens_per_rank", tokens_per_rank)
    buckets, lens = wlb_distca_buckets(doc_lens, n_ranks // cp, cap, model)
    return per_doc_cp_layout(buckets, lens, cp)


def replica_gather_tokens(layout: Layout, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-document CP's all-gather as WLB-LLM's code runs it (``per_doc_cp_attn.py:126-153``), per
    rank in tokens ``(sent, received)``: every rank of a CP group (ranks ``g cp ... g cp + cp - 1``)
    gathers the K, V of every document its group holds, whether it holds a piece of it or not. With
    whole documents per group (WLB-LLM's packer) that is the whole group's tokens: rank ``r``
    receives ``T_g - own_r`` and sends its ``own_r`` to the ``cp - 1`` others. A document cut
    over ``H_d`` groups (ours, ``balanced``) is gathered by all their ``cp H_d`` ranks:
    ``received_r = sum_{d in g} len_d - own_r``, ``sent_r = sum_d own_{r,d} (cp H_d - 1)``; at
    ``cp = 1`` this is :func:`per_doc_gather_tokens`. The backward's reduce-scatter of dK, dV is
    the mirror, ``(received, sent)``."""
    cp = _check_int("cp", cp)
    R = layout.n_ranks
    if R % cp:
        raise ValueError(f"cp={cp} must divide the layout's {R} ranks")
    ch = layout.chunk_array()
    if not ch.shape[0]:
        return np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
    lens = np.asarray(layout.doc_lens, dtype=np.int64)
    own = layout.tokens_per_rank().astype(np.int64)
    G = R // cp
    held = np.unique(ch[:, 0] * G + ch[:, 3] // cp)             # (document, group) pairs
    doc, grp = held // G, held % G
    group_docs = np.bincount(grp, weights=lens[doc], minlength=G).astype(np.int64)
    groups_of = np.bincount(doc, minlength=lens.size)           # H_d
    sent = np.bincount(ch[:, 3], weights=(ch[:, 2] - ch[:, 1]) * (cp * groups_of[ch[:, 0]] - 1),
                       minlength=R).astype(np.int64)
    return sent, np.repeat(group_docs, cp) - own


# ---------------------------------------------------------------------------------------------------
# Per-rank costs of a layout
# ---------------------------------------------------------------------------------------------------

def rank_costs(layout: Layout, model: ModelSpec | str | None = None, backward: bool = False,
               layers: int | None = None) -> dict[str, np.ndarray]:
    """Per-rank load of a layout when every chunk runs where it lives (no CAD).

    A chunk ``(doc, s, e)`` is the causal CA-task ``[s, e)`` with KV prefix ``[0, e)``:
    ``pairs = (e(e+1) - s(s+1)) / 2``. Returns arrays ``tokens``, ``attention_pairs``,
    ``linear_flops`` (``tokens * linear_flops_per_token``), ``attention_flops``
    (``4 * pairs * n_heads * head_dim`` per layer, x3.5 with backward) and ``total_flops``;
    ``layers=None`` counts all of ``model``'s layers (default model llama3-8b)."""
    m = as_model(model)
    tokens = layout.tokens_per_rank()
    pairs = np.array([sum(causal_pairs(c.start, c.end) for c in r) for r in layout.ranks], dtype=np.float64)
    lin = tokens * m.linear_flops_per_token(backward=backward, layers=layers)
    attn = np.asarray(m.attention_flops(pairs, backward=backward, layers=layers), dtype=np.float64)
    return {"tokens": tokens, "attention_pairs": pairs, "linear_flops": lin, "attention_flops": attn,
            "total_flops": lin + attn}
