"""The communication plan of CAD: all-to-all split sizes and index maps, built once per step.

Every rank holds the same global :class:`~cadlib.plan.Plan`. :func:`build_dispatch` turns it, for
one rank, into host metadata (numpy) that the forward and backward all-to-alls and the attention
server need; :meth:`Dispatch.to` moves the index arrays to the device once. Nothing here touches a
device tensor's values, so building it never synchronises the device.

Buffers (all row-major over tokens):

* **local buffer** of rank ``r``: its tokens in layout order, ``layout.ranks[r]``'s chunks one after
  another (``n_local`` rows). Q, K, V, O, dO, LSE of the linear layers live here.
* **Q exchange** (home -> server): rank ``r`` sends the query rows of its tasks served elsewhere,
  grouped by server, tasks in plan order. Self-served tasks are not sent.
* **KV exchange** (owner -> server), deduplicated: a server needs the prefix ``[0, e_{s,d})`` of each
  document ``d`` it serves, ``e_{s,d} = max q_end`` over its tasks of ``d``. Owner ``o`` sends each of
  its tokens of that prefix once per (server, document), grouped by server, documents ascending,
  positions ascending; tokens the server holds itself are not sent. Hence the KV send counts equal
  ``Plan.token_matrices()[1]``.
* **server buffers** ``cat([local, received])`` for Q and for KV. The fused kernel call reads, per
  served task ``t`` (longest KV prefix first), query rows ``q_rows`` (``n_q(t)`` of them) and a contiguous KV
  segment ``kv_rows`` = the document's prefix ``[0, q_end(t))`` (gathered; a prefix shared by several
  tasks is received once and gathered several times). ``cu_q``/``cu_k`` delimit the segments.
* **return** of O/LSE/dQ (server -> home) reverses the Q exchange: ``ret_rows`` picks, from the
  server's output rows, the rows each home receives, in the order it sent them; the home writes them
  to ``q_send_index`` and its self-served rows from ``self_rows`` to ``self_local``. dK/dV contributions
  are scatter-added over ``kv_rows`` into the KV server buffer; its received part goes back along the
  reversed KV exchange and the owner adds it at ``kv_send_index``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .plan import Layout, Plan


@dataclass
class Dispatch:
    """One rank's view of a plan's communication (host metadata; see the module docstring)."""

    rank: int
    world: int
    n_local: int
    # Q exchange, home side and server side
    q_send_index: np.ndarray           # local rows sent, grouped by destination server
    q_send_splits: list[int]
    q_recv_splits: list[int]
    # KV exchange (deduplicated per (server, doc))
    kv_send_index: np.ndarray
    kv_send_splits: list[int]
    kv_recv_splits: list[int]
    # the fused kernel call on this server
    tasks: list[int]                   # plan indices of the tasks this rank serves, in call order
    q_rows: np.ndarray                 # rows of cat([local, q_recv]) per served query token
    kv_rows: np.ndarray                # rows of cat([local, kv_recv]) per task KV segment token
    cu_q: np.ndarray                   # int32 [n_tasks + 1]
    cu_k: np.ndarray                   # int32 [n_tasks + 1]
    max_q: int
    max_k: int
    # return path of per-query rows (O, LSE, dQ)
    ret_rows: np.ndarray               # server output rows in the order of the received Q buffer
    self_rows: np.ndarray              # server output rows of self-served queries ...
    self_local: np.ndarray             # ... and where they live in the local buffer
    # whether any rank sends anything (the same on every rank: skip collectives that move nothing)
    q_traffic: bool = True
    kv_traffic: bool = True
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_recv_q(self) -> int:
        return int(sum(self.q_recv_splits))

    @property
    def n_recv_kv(self) -> int:
        return int(sum(self.kv_recv_splits))

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    def to(self, device) -> "DeviceDispatch":
        """Index arrays as device tensors, copied once per device and cached."""
        import torch

        key = str(device)
        if key not in self._device_cache:
            def t(a, dtype=torch.int64):
                return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
            self._device_cache[key] = DeviceDispatch(
                meta=self, q_send_index=t(self.q_send_index), kv_send_index=t(self.kv_send_index),
                q_rows=t(self.q_rows), kv_rows=t(self.kv_rows), cu_q=t(self.cu_q, torch.int32),
                cu_k=t(self.cu_k, torch.int32), ret_rows=t(self.ret_rows), self_rows=t(self.self_rows),
                self_local=t(self.self_local))
        return self._device_cache[key]


@dataclass
class DeviceDispatch:
    """The index arrays of a :class:`Dispatch` on one device; split sizes stay on the host."""

    meta: Dispatch
    q_send_index: object
    kv_send_index: object
    q_rows: object
    kv_rows: object
    cu_q: object
    cu_k: object
    ret_rows: object
    self_rows: object
    self_local: object


def local_index_map(layout: Layout) -> list[np.ndarray]:
    """Per document, an int array: each token's row in its owner's local buffer."""
    lidx = [np.empty(n, dtype=np.int64) for n in layout.doc_lens]
    for chunks, offs in zip(layout.ranks, layout.local_offsets()):
        for c, off in zip(chunks, offs):
            lidx[c.doc][c.start:c.end] = np.arange(off, off + c.length, dtype=np.int64)
    return lidx


def kv_needs(plan: Plan) -> dict[tuple[int, int], int]:
    """``{(server, doc): e}``: the server needs KV prefix ``[0, e)`` of the doc, ``e = max q_end``."""
    need: dict[tuple[int, int], int] = {}
    for t in plan.tasks:
        key = (t.server, t.doc)
        need[key] = max(need.get(key, 0), t.q_end)
    return need


def _rank_within_groups(groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For each element, how many earlier elements share its group; and the count per group."""
    counts = np.bincount(groups, minlength=n_groups)
    order = np.argsort(groups, kind="stable")
    within = np.empty(len(groups), dtype=np.int64)
    within[order] = np.arange(len(groups), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return within, counts


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _cu(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int32)


def build_dispatch(plan: Plan, rank: int) -> Dispatch:
    """Rank ``rank``'s communication plan for ``plan`` (host metadata; vectorised over tokens).

    Per-task and per-(server, doc) Python loops only; token index arrays come from numpy slices."""
    layout = plan.layout
    R = layout.n_ranks
    if plan.n_servers != R:
        raise ValueError(f"plan has {plan.n_servers} servers but its layout {R} ranks; distributed CAD "
                         "runs one attention server per rank, so they must be equal")
    if not 0 <= rank < R:
        raise ValueError(f"rank {rank} is outside the plan's ranks 0..{R - 1}")
    owner = layout.owner_map()
    lidx = local_index_map(layout)
    n_local = int(layout.tokens_per_rank()[rank])
    tasks = plan.tasks

    # -- Q exchange, home side: my tasks served elsewhere, grouped by server, plan order ---------
    q_parts: list[list[np.ndarray]] = [[] for _ in range(R)]
    for t in tasks:
        if t.home == rank and t.server != rank:
            q_parts[t.server].append(lidx[t.doc][t.q_start:t.q_end])
    q_send_splits = [int(sum(len(p) for p in ps)) for ps in q_parts]
    q_send_index = _cat([p for ps in q_parts for p in ps])

    # -- Q exchange, server side: where each served task's query rows land ----------------------
    # Receive positions follow the homes' send order (plan order); the fused call then lists the
    # tasks longest KV prefix first (LPT): varlen kernels hand out tiles segment by segment, so the
    # longest tiles must not come last and leave SMs idle at the tail.
    served = [i for i, t in enumerate(tasks) if t.server == rank]
    q_recv_splits = [0] * R
    for i in served:
        if tasks[i].home != rank:
            q_recv_splits[tasks[i].home] += tasks[i].n_q
    q_base = np.cumsum([0] + q_recv_splits[:-1])
    q_fill = [0] * R
    q_rows_of: dict[int, np.ndarray] = {}
    for i in served:
        t = tasks[i]
        if t.home == rank:
            q_rows_of[i] = lidx[t.doc][t.q_start:t.q_end]
        else:
            start = n_local + int(q_base[t.home]) + q_fill[t.home]
            q_rows_of[i] = np.arange(start, start + t.n_q, dtype=np.int64)
            q_fill[t.home] += t.n_q
    served = sorted(served, key=lambda i: -tasks[i].q_end)
    q_rows = _cat([q_rows_of[i] for i in served])

    # -- KV exchange: owner side (what I send) and server side (where received tokens land) -------
    need = kv_needs(plan)
    kv_parts: list[list[np.ndarray]] = [[] for _ in range(R)]
    kv_recv_splits = [0] * R
    my_docs = []
    kv_traffic = False
    for (server, doc), e in sorted(need.items()):
        own = owner[doc][:e]
        if not kv_traffic and np.any(own != server):
            kv_traffic = True
        if server == rank:
            my_docs.append((doc, e))
            cnt = np.bincount(own, minlength=R)
            cnt[rank] = 0
            kv_recv_splits = [a + int(b) for a, b in zip(kv_recv_splits, cnt)]
        else:
            mine = own == rank
            if mine.any():
                kv_parts[server].append(lidx[doc][:e][mine])
    kv_send_splits = [int(sum(len(p) for p in ps)) for ps in kv_parts]
    kv_send_index = _cat([p for ps in kv_parts for p in ps])

    kv_base = np.cumsum([0] + kv_recv_splits[:-1]).astype(np.int64)
    kv_fill = np.zeros(R, dtype=np.int64)
    kv_loc: dict[int, np.ndarray] = {}
    for doc, e in my_docs:                      # same (doc ascending) order the owners send in
        own = owner[doc][:e]
        within, cnt = _rank_within_groups(own, R)
        remote = n_local + kv_base[own] + kv_fill[own] + within
        kv_loc[doc] = np.where(own == rank, lidx[doc][:e], remote)
        cnt[rank] = 0
        kv_fill += cnt
    kv_rows = _cat([kv_loc[tasks[i].doc][:tasks[i].q_end] for i in served])

    # -- return path: received Q buffer order <- server output rows --------------------------------
    n_rows = len(q_rows)
    is_remote = q_rows >= n_local
    ret_rows = np.empty(int(is_remote.sum()), dtype=np.int64)
    ret_rows[q_rows[is_remote] - n_local] = np.flatnonzero(is_remote)
    self_rows = np.flatnonzero(~is_remote).astype(np.int64)
    self_local = q_rows[~is_remote]
    assert n_rows == len(self_rows) + len(ret_rows)

    n_q = [tasks[i].n_q for i in served]
    n_k = [tasks[i].q_end for i in served]
    return Dispatch(
        rank=rank, world=R, n_local=n_local,
        q_send_index=q_send_index, q_send_splits=q_send_splits, q_recv_splits=q_recv_splits,
        kv_send_index=kv_send_index, kv_send_splits=kv_send_splits, kv_recv_splits=kv_recv_splits,
        tasks=served, q_rows=q_rows, kv_rows=kv_rows, cu_q=_cu(n_q), cu_k=_cu(n_k),
        max_q=max(n_q, default=0), max_k=max(n_k, default=0),
        ret_rows=ret_rows, self_rows=self_rows, self_local=self_local,
        q_traffic=any(t.home != t.server for t in tasks), kv_traffic=kv_traffic)


def build_all(plan: Plan) -> list[Dispatch]:
    """Every rank's :class:`Dispatch` (single-process use: tests, notebooks, simulated exchange)."""
    return [build_dispatch(plan, r) for r in range(plan.layout.n_ranks)]


def simulate_exchange(dispatches: list[Dispatch], buffers: list[np.ndarray], kind: str) -> list[np.ndarray]:
    """Run one all-to-all in one process with numpy: ``kind`` ``"q"`` or ``"kv"``; ``buffers[r]`` is
    rank ``r``'s local buffer; returns each rank's received buffer (sources in rank order)."""
    if kind not in ("q", "kv"):
        raise ValueError(f"unknown exchange {kind!r}; choose one of: q, kv")
    R = len(dispatches)
    sent = []
    for d, buf in zip(dispatches, buffers):
        idx = d.q_send_index if kind == "q" else d.kv_send_index
        splits = d.q_send_splits if kind == "q" else d.kv_send_splits
        sent.append(np.split(buf[idx], np.cumsum(splits)[:-1]))
    out = []
    for dst in range(R):
        recv = [sent[src][dst] for src in range(R)]
        expect = dispatches[dst].q_recv_splits if kind == "q" else dispatches[dst].kv_recv_splits
        if [len(x) for x in recv] != list(expect):
            raise ValueError(f"rank {dst} expects {expect} rows but is sent {[len(x) for x in recv]}")
        out.append(np.concatenate(recv) if recv else buffers[dst][:0])
    return out
