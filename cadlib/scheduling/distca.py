"""DistCA's own planner, re-expressed on cadlib's types: the published baseline for the scheduler claim.

Read in github.com/hao-ai-lab/DistCA at commit ``2afd219296077f0ad55b2351d4febbdeba80bc78``
(2026-04-01), ``distca/planner/planner.py`` (``Planner.plan_items``, ``Item.get_priority``,
``Item.split_item``, ``batch_to_items_general`` / ``batch_to_items_with_dummy``); the training path
calls it from ``distca/utils/test_util.py::create_qkv_dispatch_pipeline_tick``, which tries
``tolerance_factor`` 0.05, 0.1, ... 1.0 until the all-to-all buffer fits. (``distca/planner/
equal_flops.py::plan_relocation`` is an older water-filling that nothing calls; the repository's
docs do not describe the planner.) What that code does:

* **Items.** One item is one rank's share of one document, held as a *head* and a *tail* piece that
  mirror each other about the document's middle (a whole document: head ``ceil(n/2)``, tail
  ``floor(n/2)`` tokens; ``batch_to_items_general``, L190-271). FLOPs are causal pairs,
  ``q*kv - q(q-1)/2`` per piece (= cadlib's pairs; ``Item.get_flops``, L366-378): the planner's only
  cost, no kernel profile.
* **Donors and receivers** (``Planner.plan_items``, L627-731). ``surplus = load - mean``; receivers
  are the servers below the mean, served one after another, most needy first. A receiver takes work
  while its need exceeds ``tolerance_factor * mean`` (default 0.1, L554; ``while needed_flops >
  threshold_flops``, L673); donors are all servers with ``surplus > 0``. So the tolerance bounds how
  far a *receiver* stays below the mean; nothing bounds the donors from above, and no threshold on
  the improvement ends the loop (the paper's text has one).
* **Pricing** (``Item.get_priority``, L394-402). Every item on every donor is a candidate with
  ``F = min(donor surplus, need, item pairs)`` and priority ``(q_size * F / (n+1) + kv_size * (n+1)) / F``
  (``n`` the document's length): estimated elements sent per pair, as if the shard sent ``F/(n+1)``
  query tokens and the *whole* document's KV, whatever the receiver already holds. The lowest priority
  wins (first on ties: a stable sort, L698).
* **Moves** (``Item.split_item``, L404-495). If ``F`` covers the item it moves whole. Otherwise
  ``m = floor(F / (n+1))`` token *pairs* move: the last ``m`` tokens of the head and the first ``m`` of
  the tail (a token pair carries ``n+1`` attention pairs), i.e. query tokens from both pieces,
  middle-out, as a new head/tail item on the receiver; ``m = 0`` ends the receiver's turn (L441).
  There is no minimum shard size; only even lengths are supported.

How this port differs, where cadlib's input or the code leaves a choice:

* cadlib's layout is given, not built by DistCA's batching: the chunks of document ``d`` on rank
  ``r`` form one item when there are exactly two (the lower is the head, the upper the tail: the
  zigzag layout's head/tail chunks); otherwise every chunk ``[a, b)`` is an item of its own, cut at
  ``a + ceil((b-a)/2)`` (what DistCA does to a whole document), so moves take its middle first.
* a pair of tokens carries ``hb + ta + 1`` pairs exactly (``hb`` the head's end, ``ta`` the tail's
  start; ``n + 1`` for DistCA's mirrored pieces of even documents), so odd lengths work; the priority
  keeps DistCA's estimate with ``n`` the document length.
* ``min_shard``: a partial move of fewer than ``min_shard`` query tokens (``2m``) is raised to
  ``min_shard`` tokens where the item has them, overshooting the need by less than ``min_shard/2``
  token pairs (``min_shard=1`` is DistCA's behaviour).
* the priority is in bytes (the model's ``q_bytes``, ``kv_bytes``); DistCA counts elements, which
  ranks candidates the same. One fixed ``tolerance`` here: DistCA's retry with larger tolerance
  factors until its all-to-all buffer fits is :func:`cadlib.scheduling.buffer.fit_buffer`.
* ``n_servers`` below the rank count starts each chunk on server ``home % n_servers``, as cadlib does.
* ``meta['reached']`` is cadlib's criterion (max ``<= (1 + tolerance) * mean``);
  ``meta['receivers_met']`` DistCA's own (every receiver within ``tolerance * mean`` of the mean).
"""
from __future__ import annotations

import time

import numpy as np

from ..core.cost import as_model, causal_pairs, imbalance
from ..core.layout import Layout
from ..core.plan import Plan, transfer_tokens
from .greedy import check_args


def _items(ch: np.ndarray):
    """Items from ``Layout.chunk_array`` rows: ``doc, home, head [ha, hb), tail [ta, tb)``."""
    o = np.lexsort((ch[:, 1], ch[:, 0], ch[:, 3]))              # by rank, doc, start
    c = ch[o]
    key = c[:, 3] * (int(c[:, 0].max(initial=0)) + 1) + c[:, 0]
    start = np.r_[True, key[1:] != key[:-1]]
    gid = np.cumsum(start) - 1
    size = np.bincount(gid)[gid]
    pair_first = (size == 2) & start                            # head/tail chunks of one (rank, doc)
    single = size != 2
    d, h = c[single, 0], c[single, 3]
    a, b = c[single, 1], c[single, 2]
    mid = a + (b - a + 1) // 2
    i = np.flatnonzero(pair_first)
    d2, h2 = c[i, 0], c[i, 3]
    cols = [np.r_[d, d2], np.r_[h, h2], np.r_[a, c[i, 1]], np.r_[mid, c[i, 2]], np.r_[mid, c[i + 1, 1]],
            np.r_[b, c[i + 1, 2]]]
    order = np.lexsort((cols[2], cols[0], cols[1]))            # rank-major, as DistCA lists its items
    return [x[order].astype(np.int64) for x in cols]


def distca_plan(layout: Layout, n_servers: int | None = None, model=None, tolerance: float = 0.1,
                min_shard: int = 1, dtype: str = "bf16", chunks: np.ndarray | None = None) -> Plan:
    """Place ``layout``'s CA-tasks with DistCA's released planner (see the module docstring) and
    return the :class:`~cadlib.core.plan.Plan`. ``tolerance`` is DistCA's ``tolerance_factor``;
    ``model`` prices moves as DistCA does (``q_bytes`` per query token, ``kv_bytes`` per KV token).
    ``plan.meta``: ``n_moves, n_splits, reached, receivers_met, imbalance_before/after, moved_bytes``
    (forward bytes added to the colocated placement's), ``seconds``."""
    S, tol, msh = check_args(layout, n_servers, tolerance, min_shard)
    spec = as_model(model)
    qb, kvb = float(spec.q_bytes(dtype)), float(spec.kv_bytes(dtype))
    t0 = time.perf_counter()
    ch = layout.chunk_array() if chunks is None else chunks
    doc, home, ha, hb, ta, tb = _items(ch)
    server = home % S
    n = np.asarray(layout.doc_lens, dtype=np.int64)[doc].astype(np.float64) + 1.0   # DistCA's n + 1
    pairs = causal_pairs(ha, hb) + causal_pairs(ta, tb)
    load = np.bincount(server, weights=pairs.astype(np.float64), minlength=S)
    before, mean = imbalance(load), load.sum() / S
    surplus, threshold = load - mean, tol * mean
    half = -(-msh // 2)                                         # min_shard tokens = half pairs each side
    grow = {"doc": [], "home": [], "ha": [], "hb": [], "ta": [], "tb": [], "server": []}
    n_moves = n_splits = 0
    for r in sorted(np.flatnonzero(surplus < 0).tolist(), key=lambda i: surplus[i]):
        need = -surplus[r]
        while need > threshold:
            cand = np.flatnonzero((surplus[server] > 0) & (pairs > 0))
            if not cand.size:
                break
            F = np.minimum(np.minimum(surplus[server[cand]], need), pairs[cand])
            j = int(np.argmin((qb * F / n[cand] + kvb * n[cand]) / F))   # DistCA's priority, first on ties
            i, f = int(cand[j]), F[j]
            s = int(server[i])
            if f >= pairs[i]:                                   # the whole item moves
                moved = int(pairs[i])
                server[i] = r
            else:
                per, side = int(hb[i] + ta[i] + 1), int(min(hb[i] - ha[i], tb[i] - ta[i]))
                m = min(int(f // per), side)
                if m == 0:
                    break                                       # DistCA: nothing to move, next receiver
                if 2 * m < msh:
                    m = min(half, side)
                moved = m * per
                for k, v in (("doc", doc[i]), ("home", home[i]), ("ha", hb[i] - m), ("hb", hb[i]),
                             ("ta", ta[i]), ("tb", ta[i] + m), ("server", r)):
                    grow[k].append(int(v))
                hb[i] -= m
                ta[i] += m
                pairs[i] -= moved
                n_splits += 1
            n_moves += 1
            surplus[s] -= moved
            surplus[r] += moved
            need -= moved
        k = len(grow["doc"])
        if k:                                                   # the receiver's new items join the rest
            doc, home, ha, hb, ta, tb, server = (np.r_[x, np.asarray(grow[nm], dtype=np.int64)]
                                                 for x, nm in ((doc, "doc"), (home, "home"), (ha, "ha"),
                                                               (hb, "hb"), (ta, "ta"), (tb, "tb"),
                                                               (server, "server")))
            pairs = np.r_[pairs, causal_pairs(ha[-k:], hb[-k:]) + causal_pairs(ta[-k:], tb[-k:])]
            n = np.r_[n, np.asarray(layout.doc_lens, dtype=np.float64)[doc[-k:]] + 1.0]
            for v in grow.values():
                v.clear()
    return _to_plan(layout, ch, S, spec, dtype, tol, msh, before, threshold, n_moves, n_splits, t0,
                    doc, home, ha, hb, ta, tb, server)


def _to_plan(layout, ch, S, spec, dtype, tol, msh, before, threshold, n_moves, n_splits, t0,
             doc, home, ha, hb, ta, tb, server) -> Plan:
    """The items as tasks (head and tail one task where they touch), with the plan's meta."""
    one = (hb == ta) & (hb > ha) & (tb > ta)
    hb2 = np.where(one, tb, hb)                                 # a contiguous item is one task
    head, tail = hb2 > ha, (tb > ta) & ~one
    cols = [np.r_[x[head], x[tail]] for x in (doc, home, server)]
    qs, qe = np.r_[ha[head], ta[tail]], np.r_[hb2[head], tb[tail]]
    plan = Plan.from_arrays(layout, cols[0], qs, qe, cols[1], cols[2], n_servers=S, chunks=ch, check=False)
    load = plan.server_pairs()
    mean = load.sum() / S
    recv0 = ch[:, 3] % S                                        # colocated bytes, for moved_bytes
    q0, kv0 = transfer_tokens(ch, ch[:, 0], ch[:, 1], ch[:, 2], ch[:, 3], recv0, layout.n_ranks, S)
    base = float(q0.sum() * spec.q_bytes(dtype) + kv0.sum() * spec.kv_bytes(dtype))
    plan.meta = {"method": "distca", "n_moves": n_moves, "n_splits": n_splits, "tolerance": tol,
                 "reached": bool(load.max() <= (1 + tol) * mean * (1 + 1e-12)),
                 "receivers_met": bool((mean - load).max(initial=0) <= threshold * (1 + 1e-12) + 1e-9),
                 "min_shard": msh, "n_servers": S, "model": spec.name, "dtype": dtype,
                 "imbalance_before": before, "imbalance_after": imbalance(load),
                 "moved_bytes": plan.forward_bytes(spec, dtype) - base, "guard": False,
                 "seconds": time.perf_counter() - t0}
    return plan
