"""The static index of the scheduler engine (:mod:`cadlib.scheduling.engine`): what the greedy looks up
about the layout's chunks and never changes while it moves tasks.

* per document its chunks (``by_doc`` order, ``doc_ptr`` bounds) and their holders (``holder_of``: the
  rank, or -1 when that rank is not a server);
* ``owned(g, d, e)``: tokens of ``[0, e)`` of document ``d`` that rank ``g`` holds, a binary search in
  the chunks sorted by ``(rank, doc, start)`` with cumulative lengths;
* the prefix end ``need`` per (server, doc) of the colocated placement (sorted keys
  ``server * n_docs + doc``, ``need_key``, and their largest ``q_end``, ``need_end``);
* :meth:`ChunkIndex.forward_tokens`: the query and KV tokens a set of tasks dispatches (the forward
  bytes of :meth:`cadlib.core.plan.Plan.forward_bytes`, restricted to whole documents).
"""
from __future__ import annotations

import numpy as np


class ChunkIndex:
    """Built from the chunks' ``doc, a, b, home`` and their colocated ``server``s."""

    def __init__(self, doc: np.ndarray, a: np.ndarray, b: np.ndarray, home: np.ndarray, server: np.ndarray,
                 n_docs: int, n_servers: int):
        # (a, b must not change later: they are kept when already in order. Few full-size temporaries:
        # each is fresh memory, page faults, at 10^4-10^5 chunks.)
        self.n_docs = n_docs
        self.by_doc = np.argsort(doc, kind="stable")
        self.doc_ptr = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(np.bincount(doc, minlength=n_docs), out=self.doc_ptr[1:])
        homes_are_servers = not home.size or int(home.max()) < n_servers    # then server is home
        holder = home[self.by_doc]
        self.holder_of = holder if homes_are_servers else np.where(holder < n_servers, holder, -1)
        self.big = int(b.max(initial=0)) + 1
        grp = self.own_grp = home * n_docs
        grp += doc
        ordered = _ascending(grp, a)
        if ordered:                                            # rank-major chunk arrays are sorted already
            self.own_a, self.own_b = a, b
        else:
            o = np.lexsort((a, doc, home))
            self.own_grp, self.own_a, self.own_b = grp[o], a[o], b[o]
        self.own_key = self.own_grp * self.big
        self.own_key += self.own_a
        self.own_cum = np.zeros(a.size + 1, dtype=np.int64)
        np.cumsum(self.own_b - self.own_a, out=self.own_cum[1:])
        if homes_are_servers and ordered:                      # the colocated keys are the holders' keys
            self.need_key, self.need_end = self.prefix_ends(grp, b, ordered=True)
        else:
            self.need_key, self.need_end = self.prefix_ends(server * n_docs + doc, b)

    @staticmethod
    def prefix_ends(key: np.ndarray, b: np.ndarray, ordered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The distinct ``key``s, sorted, and the largest ``b`` of each (``ordered``: ``key`` is
        sorted)."""
        if not key.size:
            return key, key
        if not ordered and not bool((key[1:] >= key[:-1]).all()):   # rank-major chunk arrays: sorted
            o = np.argsort(key, kind="stable")
            key, b = key[o], b[o]
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        return key[first], np.maximum.reduceat(b, first)

    def owned(self, g: np.ndarray, d: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Tokens of ``[0, e)`` of documents ``d`` held by ranks ``g`` (elementwise)."""
        grp = g * self.n_docs + d
        lo = self.own_grp.searchsorted(grp, side="left")
        j = self.own_key.searchsorted(grp * self.big + e, side="left") - 1   # last chunk starting < e
        ok = j >= lo
        j *= ok
        part = np.minimum(e, self.own_b[j]) - self.own_a[j]
        return (self.own_cum[j] - self.own_cum[lo] + part) * ok

    def owned1(self, g: int, d: int, e: int) -> int:
        """``owned`` of one rank, document and end."""
        grp = g * self.n_docs + d
        lo = int(self.own_grp.searchsorted(grp))
        j = int(self.own_key.searchsorted(grp * self.big + e)) - 1
        return int(self.own_cum[j] - self.own_cum[lo]) + min(e, int(self.own_b[j])) - int(self.own_a[j]) \
            if j >= lo else 0

    def kv(self, g, d, e):
        """KV tokens server ``g`` fetches to serve ``d`` up to ``e``: ``e - owned(g, d, e)``."""
        return e - self.owned(g, d, e)

    def doc_chunks(self, docs: np.ndarray) -> np.ndarray:
        """The chunks (indices) of documents ``docs``."""
        lo, hi = self.doc_ptr[docs], self.doc_ptr[docs + 1]
        cnt = hi - lo
        return self.by_doc[np.repeat(lo - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum())]

    def forward_tokens(self, doc, a, b, home, server) -> tuple[int, int]:
        """``(query tokens, KV tokens)`` the tasks ``doc, [a, b), home, server`` dispatch, when they are
        all the tasks of their documents: queries served off their home, and per (server, doc) the KV
        prefix ``[0, max b)`` less what the server's rank holds."""
        q = int(((b - a) * (home != server)).sum())
        key, need = self.prefix_ends(server * self.n_docs + doc, b)
        g, d = np.divmod(key, self.n_docs)
        return q, int(self.kv(g, d, need).sum())

    def moved_bytes(self, ch, cols, shards, n_servers: int, q_bytes: int, kv_bytes: int) -> int:
        """Forward bytes that tasks ``cols`` (``doc, a, b, home, server`` arrays) plus the cut
        ``shards`` (rows of the same five fields) dispatch beyond the colocated placement of chunks
        ``ch``, their documents' chunks."""
        home = ch[:, 3]
        q0, kv0 = self.forward_tokens(ch[:, 0], ch[:, 1], ch[:, 2], home, home % n_servers)
        if shards:
            extra = np.array(shards, dtype=np.int64)
            cols = [np.concatenate((x, extra[:, j])) for j, x in enumerate(cols)]
        q1, kv1 = self.forward_tokens(*cols)
        return q_bytes * (q1 - q0) + kv_bytes * (kv1 - kv0)


def _ascending(grp: np.ndarray, a: np.ndarray) -> bool:
    """Whether the pairs ``(grp, a)`` are in ascending order."""
    if grp.size < 2:
        return True
    dg = grp[1:] - grp[:-1]
    return bool((dg >= 0).all() and ((dg > 0) | (a[1:] > a[:-1])).all())


def other_ends(key: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per task (group ``key``: server and document, ends ``b``), the largest ``b`` of the other
    tasks of its group (0 if none)."""
    o = np.lexsort((b, key))
    ks, bs = key[o], b[o]
    new = np.ones(ks.size + 1, dtype=bool)
    np.not_equal(ks[1:], ks[:-1], out=new[1:-1])
    last = new[1:]
    top = np.repeat(bs[last], np.diff(np.flatnonzero(new)))
    second = np.where(new[:-1], 0, np.concatenate(([0], bs[:-1])))
    other = np.empty_like(bs)
    other[o] = np.where(last, second, top)
    return other
