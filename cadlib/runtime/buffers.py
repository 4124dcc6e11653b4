"""Where a rank's rows sit in the attention server's buffers, and how they get home.

A server's per-query buffer is ``cat([local[:q_keep], received])`` and its KV buffer ``cat([local,
received])``; on a sent-last plan both may be received first (:class:`cadlib.dispatch.meta.Dispatch`
says which, and where each part starts). These helpers read that layout from the dispatch; the stages
of :mod:`cadlib.runtime.stages` and nothing else call them."""
from __future__ import annotations

import torch

from ..dispatch.meta import Dispatch
from .comm import exchange
from .device import DeviceDispatch


def rows_cat(local: torch.Tensor, recv: torch.Tensor, recv_first: bool = False) -> torch.Tensor:
    """A server buffer ``cat([local, recv])`` (``recv_first``: ``cat([recv, local])``); no copy (a view
    of ``local``) when nothing was received."""
    if not recv.shape[0]:
        return local.view_as(local)
    return torch.cat([recv, local] if recv_first else [local, recv])


def home_rows(rows: torch.Tensor, n_local: int, start: int = 0) -> torch.Tensor:
    """Rows ``[start, start + n_local)`` of a server's output (a ``q_identity`` server's own rows): a
    view when the other rows (received queries, returned elsewhere) are at most an eighth as many,
    since a view keeps them alive as long as the home's output lives (to the backward); else a copy."""
    own = rows[start:start + n_local]
    return own if rows.shape[0] - n_local <= n_local // 8 else own.clone()


def server_rows(local: torch.Tensor, recv: torch.Tensor, m: Dispatch) -> torch.Tensor:
    """A server's per-query buffer ``cat([local[:q_keep], recv])`` (``q_keep = n_local`` unless the
    server reads a sent-last prefix in place, :class:`cadlib.dispatch.meta.Dispatch`); on a sent-last plan
    received first, ``cat([recv, local[:q_keep]])``."""
    return rows_cat(local[:m.q_keep], recv, m.recv_first)


def kv_rows_cat(local: torch.Tensor, recv: torch.Tensor, m: Dispatch) -> torch.Tensor:
    """A server's KV buffer ``cat([local, recv])`` (sent-last plans: ``cat([recv, local])``)."""
    return rows_cat(local, recv, m.recv_first)


def recv_part(buf: torch.Tensor, m: Dispatch, kv: bool = False) -> torch.Tensor:
    """The received rows of a server buffer (or of a ``q_identity`` server's output rows, which are its
    query buffer's order): what goes back along the reversed exchange."""
    lo, n = (m.kv_recv_at, m.n_recv_kv) if kv else (m.q_recv_at, m.n_recv_q)
    return buf[lo:lo + n]


def local_part(buf: torch.Tensor, m: Dispatch, kv: bool = False) -> torch.Tensor:
    """The local rows of a server buffer: all ``n_local`` of a KV buffer, or a query buffer's
    ``q_keep`` (``n_local`` unless a sent-last server reads a prefix in place)."""
    lo, n = (m.kv_local_at, m.n_local) if kv else (m.q_local_at, m.q_keep)
    return buf[lo:lo + n]


def send_rows(comm, parts, dd: DeviceDispatch):
    """Start the Q exchange (home -> servers) of per-query tensors ``parts``: the rows served elsewhere,
    in send order; a ``q_identity`` rank's are the slice after its kept rows (no gather)."""
    m = dd.meta
    if m.q_identity:
        lo, hi = m.q_keep, m.q_keep + m.n_send_q
        return exchange(comm, [p[lo:hi] for p in parts], None, m.q_send_splits, m.q_recv_splits, m.q_traffic,
                         source=parts)
    return exchange(comm, parts, dd.q_send_index, m.q_send_splits, m.q_recv_splits, m.q_traffic)


def to_home(own: torch.Tensor, back: torch.Tensor, dd: DeviceDispatch) -> torch.Tensor:
    """A home's per-query rows ``[n_local, ...]`` from its server's rows ``own`` (task-row order) and
    the rows ``back`` its sent rows got back (send order). ``q_identity``: the first ``q_keep`` server
    rows are the home's first rows (:func:`home_rows`; on a sent-last plan they follow the received ones),
    then the sent tail, then zeros for rows in no task (a nano-batch's KV-only context); else
    self-served rows and returned rows are scattered."""
    m = dd.meta
    if m.q_identity:
        rest = m.n_local - m.q_keep - back.shape[0]
        if not back.shape[0] and not rest:
            return home_rows(own, m.q_keep, m.q_local_at)
        pad = [own.new_zeros((rest, *own.shape[1:]))] if rest else []
        return torch.cat([local_part(own, m), back, *pad])
    home = own.new_empty((m.n_local, *own.shape[1:]))
    home.index_copy_(0, dd.self_local, own.index_select(0, dd.self_rows))
    return home.index_copy_(0, dd.q_send_index, back)
