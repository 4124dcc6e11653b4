"""Donor views of the CAD greedy (:mod:`cadlib.scheduling.engine`): what the candidate moves of a
donor's tasks need from them, gathered once and kept while the donor waits.

A donor's tasks change only when it moves, so its :class:`DonorView` (its live tasks and their fields,
the other tasks' prefix end per task, the KV it fetches now, and the chunks of each task's document
with their holders) is built for every donor at once when the greedy starts
(:meth:`Views.build_views`, one numpy pass) and updated in place after the donor moves
(:meth:`Views.shrink_view`). Its candidate (task, receiver) rows, with the task fields they need packed
beside them (:class:`Candidates`, :meth:`Views.candidate_rows`), are kept until the donor moves or one
of its documents gets a new shard server.
"""
from __future__ import annotations

import numpy as np

from .index import other_ends

FIELDS = ("doc", "a", "b", "home", "min_pairs", "pairs", "other", "kv_now", "cheap")
ROWS = ("task", "receiver", *FIELDS)
_NONE = np.iinfo(np.int64).max


class DonorView:
    """A donor's live tasks (plan indices ``tasks``) and their fields, the rows of one array ``cols``
    (:data:`FIELDS`, each also an attribute viewing its row): document, ``a``, ``b``, home, the pairs
    of the smallest valid move (``min_pairs``) and of the task (``pairs``), the donor's prefix end for
    the task's document without the task (``other``), the KV tokens the donor fetches for that
    document now (``kv_now``), the task's end where each of its moves costs at least
    ``q_bytes / end`` per pair (``cheap``: it is served at home and its donor fetches no KV for it;
    else a bound above any end; set with the candidates), and the chunks of the task's document (``rep``:
    which task, ``chunk``, its ``holder`` rank or -1 when that rank is not a server);
    ``candidates``: its :class:`Candidates` (:meth:`Views.candidate_rows`), ``None`` until computed and
    again when the donor moves or a document of the view gets a new shard server."""

    def __init__(self, tasks: np.ndarray, cols: np.ndarray):
        self.tasks, self.cols = tasks, cols
        for f, row in zip(FIELDS, cols):
            setattr(self, f, row)
        self.rep = self.chunk = self.holder = self.candidates = None


class Candidates:
    """A donor's candidate moves, one per (task, receiver): the rows of one int64 array ``rows``
    (:data:`ROWS`, each also an attribute viewing its row): ``task`` (the task's place in the donor's
    view), ``receiver``, then the task's :data:`FIELDS` beside them."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        for f, row in zip(ROWS, rows):
            setattr(self, f, row)

    def __len__(self) -> int:
        return self.rows.shape[1]

    def where(self, keep: np.ndarray) -> "Candidates":
        """The candidates where ``keep`` is true (a copy)."""
        return Candidates(self.rows[:, keep])


class Views:
    """The view-keeping half of :class:`cadlib.scheduling.engine.Greedy` (a mixin: it reads the
    greedy's arrays, ``self.views`` and ``self.live``)."""

    def build_views(self, servers: list[int]) -> None:
        """The :class:`DonorView` of each of ``servers`` (donors), from one numpy pass over their
        tasks."""
        idx = [self.live[s][self.server[self.live[s]] == s] for s in servers]
        for s, i in zip(servers, idx):
            self.live[s] = i
        cnt = np.array([i.size for i in idx], dtype=np.int64)
        idx = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
        d, a, b = self.doc[idx], self.a[idx], self.b[idx]
        e = np.where(b - a >= 2 * self.m, a + self.m, b)             # smallest valid move: m start tokens
        mp = (e * (e + 1) - a * (a + 1)) // 2
        srv = np.repeat(np.asarray(servers, dtype=np.int64), cnt)
        other = other_ends(srv * self.n_docs + d, b)
        kv_now = self.ix.kv(srv, d, np.maximum(other, b))
        cols = [d, a, b, self.home[idx], mp, self.pairs[idx], other, kv_now, b]
        ends = np.cumsum(cnt)
        lo, n_ch = self.ix.doc_ptr[d], self.ix.doc_ptr[d + 1] - self.ix.doc_ptr[d]
        rep = np.repeat(np.arange(idx.size), n_ch)
        pos = np.repeat(lo - np.cumsum(n_ch) + n_ch, n_ch) + np.arange(rep.size)
        chunk, holder = self.ix.by_doc[pos], self.ix.holder_of[pos]
        rep_at = np.r_[0, np.cumsum(n_ch)][np.r_[0, ends]].tolist()
        cols = np.concatenate(cols).reshape(len(cols), -1)
        ends = np.r_[0, ends].tolist()
        for j, s in enumerate(servers):
            lo, hi = ends[j], ends[j + 1]
            v = DonorView(idx[lo:hi], cols[:, lo:hi])
            r0, r1 = rep_at[j], rep_at[j + 1]
            v.rep, v.chunk, v.holder = rep[r0:r1] - lo, chunk[r0:r1], holder[r0:r1]
            self.views[s] = v

    def shrink_view(self, s: int, v: DonorView, i: int, whole: bool, d: int, a: int, b: int,
                    mine: tuple[list[int], list[int]]) -> DonorView:
        """Donor ``s``'s view ``v`` after its ``i``-th task (of document ``d``) moved (``whole``) or
        shrank to ``[a, b)``; ``mine``: its tasks of ``d`` (positions in ``v``) without the one moved
        whole, and their ends."""
        if whole:
            keep = np.arange(v.tasks.size) != i
            w = DonorView(v.tasks[keep], v.cols[:, keep])
            kc = v.rep != i
            w.rep, w.chunk, w.holder = v.rep[kc], v.chunk[kc], v.holder[kc]
            w.rep -= w.rep > i
            v = w
        else:
            v.a[i], v.b[i] = a, b
            e = a + self.m if b - a >= 2 * self.m else b
            v.min_pairs[i] = (e * (e + 1) - a * (a + 1)) // 2
            v.pairs[i] = (b * (b + 1) - a * (a + 1)) // 2
        sel, bs = mine                                         # its tasks of d: the others' prefix ends
        if whole:
            sel = [j - (j > i) for j in sel]
        top = max(bs, default=0)
        second = max((x for x in bs if x != top), default=0) if bs.count(top) == 1 else top
        for j, bj in zip(sel, bs):
            v.other[j] = second if bj == top else top
        if sel:
            v.kv_now[sel] = top - self.ix.owned1(s, d, top)
        v.candidates = None
        return v

    def candidate_rows(self, s: int, v: DonorView) -> Candidates:
        """Donor ``s``'s candidate (task, receiver) rows with the task's fields beside them (:data:`ROWS`
        x candidates): first the rows of the tasks' documents' chunks' servers,
        then of the holders that are other servers and of the servers given shards of the document,
        then one per task for the emptiest receiver; the receivers of the first and last part are
        filled in per move (chunks move, and so does the emptiest receiver)."""
        h = (v.holder >= 0) & (v.holder != s)
        task, recv = [v.rep, v.rep[h]], [v.rep, v.holder[h]]
        if self.shard_servers:
            extra = [(i, r) for i in np.flatnonzero(self.has_shard[v.doc]).tolist()
                     for r in self.shard_servers[int(v.doc[i])]]
            if extra:
                et, er = np.array(extra, dtype=np.int64).T
                task.append(et)
                recv.append(er)
        task = np.concatenate((*task, np.arange(v.tasks.size)))
        v.cheap[:] = np.where((v.home == s) & (v.kv_now == 0), v.b, _NONE)
        rows = np.empty((len(ROWS), task.size), dtype=np.int64)
        rows[0] = task
        np.concatenate(recv, out=rows[1, :task.size - v.tasks.size])
        np.take(v.cols, task, axis=1, out=rows[2:])
        return Candidates(rows)
