"""A rank's communication plan as data: :class:`Dispatch`, host metadata with the per-token index maps
held as runs. :func:`cadlib.dispatch.build.build_dispatch` builds it from a plan (the buffers and maps
are described there); :func:`cadlib.runtime.device.to_device` copies it to a device."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.ranges import IndexArray
from .kvexchange import KVMap
from .kvshare import build_shared, build_shared_runs

INDEX_NAMES = ("q_send_index", "kv_send_index", "q_rows", "kv_rows", "ret_rows", "self_rows", "self_local",
               "kv_send_uniq", "kv_send_slot")


@dataclass
class Dispatch:
    """One rank's view of a plan's communication (host metadata; see the module docstring). The
    per-token maps are attributes (:class:`cadlib.core.ranges.IndexArray`) held as runs in ``index``."""

    rank: int
    world: int
    n_local: int
    # Q exchange, home side and server side; KV exchange (deduplicated per (server, doc))
    q_send_splits: list[int]
    q_recv_splits: list[int]
    kv_send_splits: list[int]
    kv_recv_splits: list[int]
    # the fused kernel call on this server
    tasks: list[int]                   # plan indices of the tasks this rank serves, in call order
    cu_q: np.ndarray                   # int32 [n_tasks + 1]
    cu_k: np.ndarray                   # int32 [n_tasks + 1]
    max_q: int
    max_k: int
    index: dict = field(repr=False)    # name -> Ranges / Gather of the maps below
    # whether any rank sends anything (the same on every rank: skip collectives that move nothing)
    q_traffic: bool = True
    kv_traffic: bool = True
    # the server reads cat([local[:q_keep], received]) as it is (q_rows == arange(q_keep) ++ n_local +
    # arange(n_recv_q)) and this rank sends rows [q_keep, q_keep + n_send_q) away (later ones: KV only)
    q_identity: bool = False
    q_keep: int | None = None          # n_local unless q_identity on a sent-last plan (prefix)
    prefix: bool = False               # a sent-last plan: buffers may be read in place as a prefix
    # a sent-last plan: the server buffers are received first, cat([received, local[:q_keep]]) and
    # cat([received KV, local]), so a document begun on another rank reads [its prefix | local rows]
    recv_first: bool = False
    # the served tasks' documents and query ranges, in call order (for the merged call)
    task_doc: np.ndarray | None = None
    task_start: np.ndarray | None = None
    task_end: np.ndarray | None = None
    kv_map: KVMap | None = field(default=None, repr=False)
    _host: dict = field(default_factory=dict, repr=False)
    _explicit: set = field(default_factory=set, repr=False)
    _device_cache: dict = field(default_factory=dict, repr=False)

    q_send_index = IndexArray()        # local rows sent, grouped by destination server
    kv_send_index = IndexArray()
    q_rows = IndexArray()              # rows of cat([local, q_recv]) per served query token
    kv_rows = IndexArray()             # rows of cat([local, kv_recv]) per task KV segment token
    ret_rows = IndexArray()            # server output rows in the order of the received Q buffer
    self_rows = IndexArray()           # server output rows of self-served queries ...
    self_local = IndexArray()          # ... and where they live in the local buffer
    kv_send_uniq = IndexArray()        # distinct rows of kv_send_index and each entry's slot among
    kv_send_slot = IndexArray()        # them: the owner sums several servers' dK/dV of one token

    def __post_init__(self):
        if self.q_keep is None:
            self.q_keep = self.n_local

    @property
    def n_recv_q(self) -> int:
        return int(sum(self.q_recv_splits))

    @property
    def n_recv_kv(self) -> int:
        return int(sum(self.kv_recv_splits))

    @property
    def n_send_q(self) -> int:
        return int(sum(self.q_send_splits))

    @property
    def n_send_kv(self) -> int:
        return int(sum(self.kv_send_splits))

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    # where the parts of the server buffers start (rows): received-first on sent-last plans
    @property
    def q_recv_at(self) -> int:
        """First row of the received queries in the query buffer (and in a ``q_identity`` server's
        output rows)."""
        return 0 if self.recv_first else self.q_keep

    @property
    def q_local_at(self) -> int:
        """Row of local row 0 in the query buffer (and in a ``q_identity`` server's output rows)."""
        return self.n_recv_q if self.recv_first else 0

    @property
    def kv_recv_at(self) -> int:
        """First row of the received KV in the KV buffer."""
        return 0 if self.recv_first else self.n_local

    @property
    def kv_local_at(self) -> int:
        """Row of local row 0 in the KV buffer."""
        return self.n_recv_kv if self.recv_first else 0

    def gathered_rows(self) -> tuple[int, int]:
        """Rows the fused call copies out of this server's buffers rather than reading them in place:
        ``(query rows, KV rows)`` of the merged call (its dQ, dK, dV are scattered back likewise)."""
        sh = self.shared()
        return (0 if self.q_identity else int(self.cu_q[-1])), (0 if sh.kv_identity else sh.n_kv)

    def shared(self):
        """The merged fused call (:class:`cadlib.dispatch.kvshare.SharedKV`), built from the current fields on
        first use and cached: from the KV map's runs, or, when ``kv_rows`` was assigned an explicit
        array, from that array."""
        if "shared" not in self._device_cache:
            if self.task_doc is None:
                raise ValueError("this Dispatch has no task_doc/task_start/task_end; build it with "
                                 "build_dispatch to use the merged (kv_share='merged') server call")
            n_buf = self.n_local + self.n_recv_kv
            if self.kv_map is None or "kv_rows" in self._explicit:
                sh = build_shared(self.task_doc, self.task_start, self.task_end, self.cu_q, self.cu_k,
                                  self.kv_rows, n_buf, self.prefix)
            else:
                sh = build_shared_runs(self.task_doc, self.task_start, self.task_end, self.cu_q, self.kv_map,
                                       n_buf, self.prefix)
            self._device_cache["shared"] = sh
        return self._device_cache["shared"]
