"""Core attention disaggregation as one autograd function: ``cad_attention(q, k, v, plan, group)``.

Each rank passes its local packed tokens (the linear layout: ``layout.ranks[rank]``'s chunks in
order), q ``[n_local, Hq, D]`` and k, v ``[n_local, Hkv, D]``, and gets back its attention output
``o [n_local, Hq, D]``, as if every document had run causal attention on one device. The data path
(one layer; ``R`` ranks, each both a home of tokens and an attention server)::

    forward
      home   q[q_send_index]               --all_to_all(Q)-->         server q_buf = [q ; recv]
      owner  [k, v][kv_send_index]         --all_to_all(KV, dedup)--> server kv_buf = [kv ; recv]
      server out, lse = attend(q_buf[q_rows], k_buf[kv_rows], v_buf[kv_rows], cu_q, cu_k)  (ONE call)
      server [out, lse][ret_rows]          --all_to_all(O+LSE)-->     home o[q_send_index]
             self-served rows stay:        o[self_local] = out[self_rows]
      home keeps q, k, v, o, lse for backward (the server keeps nothing)
    backward (stateless servers: everything is resent from the homes)
      home   [q, o, dO, lse][q_send_index] --all_to_all-->            server row buffers
      owner  [k, v][kv_send_index]         --all_to_all(KV, dedup)--> server kv_buf
      server dq, dk, dv = attend_backward(...)                         (ONE call)
             dk_buf = dK summed per KV row (fp32 only where rows are shared: cadlib.dispatch.kvshare)
      server dq[ret_rows]                  --all_to_all-->            home dq[q_send_index]
      server [dk, dv]_buf[n_local:]        --all_to_all-->            owner dk[kv_send_index] += (fp32 rows)

On a sent-last plan (``plan.meta["sent_last"]``) the server buffers are received first,
``[recv ; q[:q_keep]]`` and ``[recv ; kv]``, so the received dK/dV are ``[dk, dv]_buf[:n_recv_kv]``.

Several tensors with one row per query token travel as one byte-packed all-to-all, so a forward is
3 collectives and a backward 4; an exchange that moves nothing on any rank (known from the global
plan) is skipped on every rank. Split sizes are host lists from :mod:`cadlib.dispatch.build`; the index
tensors go to the device once per plan; nothing in the comm path reads a device value on the host.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..core.plan import Plan
from ..dispatch.build import build_dispatch
from ..dispatch.kvshare import check_mode
from ..dispatch.meta import Dispatch
from .device import DeviceDispatch, to_device
from .kernels import resolve_backend
from .server import add_rows, serve_backward, serve_forward


class AllToAll:
    """``torch.distributed.all_to_all_single`` over an explicit process group, started async so two
    exchanges can be in flight at once; ``wait()`` only orders streams (NCCL) and never syncs the host
    with the device."""

    def __init__(self, group):
        self.group = group

    def start(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], fill=None):
        """``fill(n)``: ``n`` rows packed like ``send``'s made from local rows (unused here; the
        signal-only control, :class:`cadlib.runtime.stages.SignalOnly`, receives them instead)."""
        recv = send.new_empty((int(sum(recv_splits)), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits),
                                      group=self.group, async_op=True)
        return _Pending(recv, work)


class _Pending:
    def __init__(self, recv, work):
        self.recv, self.work = recv, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.recv


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` as ``[n, bytes]`` uint8 (a view when contiguous)."""
    t = t.contiguous()
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-row tensors of any dtypes into one uint8 ``[n, sum bytes]`` buffer."""
    return tensors[0].contiguous() if len(tensors) == 1 else torch.cat([_as_bytes(t) for t in tensors], 1)


def unpack_rows(buf: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`; ``likes`` give each part's trailing shape and dtype."""
    if len(likes) == 1:
        return [buf]
    out, off, n = [], 0, buf.shape[0]
    for like in likes:
        width = math.prod(like.shape[1:]) * like.element_size()
        # Always a fresh, aligned copy: ``.contiguous()`` of a 0- or 1-row slice is the slice itself,
        # whose byte offset need not be a multiple of the part's element size.
        part = buf.new_empty((n, width)).copy_(buf[:, off:off + width]).view(like.dtype)
        out.append(part.view(n, *like.shape[1:]))
        off += width
    return out


def _exchange(comm, parts, index, send_splits, recv_splits, active, source=None):
    """Start sending ``[p[index] for p in parts]`` (packed; ``index=None``: the parts as they are);
    returns a waiter giving the unpacked received parts. When no rank moves anything, returns empty
    parts without a collective. ``source``: whole local tensors the parts come from (default the parts),
    whose rows the signal-only control receives instead (:func:`cycled_rows`)."""
    likes = [p[:0] for p in parts]
    if not active:
        return lambda: [p.new_empty((0, *p.shape[1:])) for p in parts]
    send = parts if index is None else [p.index_select(0, index) for p in parts]
    pending = comm.start(pack_rows(send), send_splits, recv_splits,
                         fill=functools.partial(cycled_rows, source or parts, likes))
    return lambda: unpack_rows(pending.wait(), likes)


def cycled_rows(source: list[torch.Tensor], likes: list[torch.Tensor], n: int) -> torch.Tensor | None:
    """``n`` rows packed as :func:`pack_rows` packs ``likes``-shaped parts: rows of ``source`` (whole
    local tensors, one per part) taken cyclically, each cast to its part's dtype; None when ``source``
    has no row."""
    rows = source[0].shape[0] if source else 0
    if not rows:
        return None
    idx = torch.arange(n, device=source[0].device) % rows
    return pack_rows([s.index_select(0, idx).to(like.dtype) for s, like in zip(source, likes)])


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
        return _exchange(comm, [p[lo:hi] for p in parts], None, m.q_send_splits, m.q_recv_splits, m.q_traffic,
                         source=parts)
    return _exchange(comm, parts, dd.q_send_index, m.q_send_splits, m.q_recv_splits, m.q_traffic)


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


def _return_rows(comm, rows, dd: DeviceDispatch):
    """Server rows (task-row order) back to their homes: self-served rows stay, the rest travel the
    reversed Q exchange (``q_identity``: the received rows, unpermuted). Returns the home tensors
    ``[n_local, ...]`` (:func:`to_home`)."""
    m = dd.meta
    if m.q_identity:
        back = _exchange(comm, [recv_part(r, m) for r in rows], None, m.q_recv_splits, m.q_send_splits,
                         m.q_traffic, source=rows)()
    else:
        back = _exchange(comm, rows, dd.ret_rows, m.q_recv_splits, m.q_send_splits, m.q_traffic)()
    return [to_home(r, b, dd) for r, b in zip(rows, back)]


def _kv_buffers(recv_kv, k, v, m: Dispatch):
    rk, rv = recv_kv
    return kv_rows_cat(k, rk, m), kv_rows_cat(v, rv, m)


class CADAttention(torch.autograd.Function):
    """Forward: dispatch Q and deduplicated KV, serve, return O (LSE kept for backward).
    Backward: resend q, k, v, o, dO, lse; serve; return dQ and summed dK, dV to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, dd: DeviceDispatch, comm, attn_backend, kv_share="merged"):
        m = dd.meta
        wait_q = send_rows(comm, [q], dd)
        wait_kv = _exchange(comm, [k, v], dd.kv_send_index, m.kv_send_splits, m.kv_recv_splits,
                            m.kv_traffic)
        (q_recv,) = wait_q()
        k_buf, v_buf = _kv_buffers(wait_kv(), k, v, m)
        out_s, lse_s = serve_forward(server_rows(q, q_recv, m), k_buf, v_buf, dd, attn_backend, kv_share)
        o, lse = _return_rows(comm, [out_s, lse_s], dd)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.dd, ctx.comm, ctx.attn_backend, ctx.kv_share = dd, comm, attn_backend, kv_share
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dd, comm, m = ctx.dd, ctx.comm, ctx.dd.meta
        dout = dout.contiguous()
        wait_rows = send_rows(comm, [q, o, dout, lse], dd)
        wait_kv = _exchange(comm, [k, v], dd.kv_send_index, m.kv_send_splits, m.kv_recv_splits,
                            m.kv_traffic)
        q_r, o_r, do_r, lse_r = wait_rows()
        k_buf, v_buf = _kv_buffers(wait_kv(), k, v, m)
        dq_s, dk_buf, dv_buf = serve_backward(server_rows(q, q_r, m), k_buf, v_buf, server_rows(o, o_r, m),
                                              server_rows(dout, do_r, m), server_rows(lse, lse_r, m), dd,
                                              ctx.attn_backend, ctx.kv_share)
        # dK/dV of received KV rows go back to their owners (reversed KV exchange, input dtype)
        back_kv = [recv_part(dk_buf, m, True).to(k.dtype), recv_part(dv_buf, m, True).to(v.dtype)]
        wait_dkv = _exchange(comm, back_kv, None, m.kv_recv_splits, m.kv_send_splits, m.kv_traffic,
                             source=[dk_buf, dv_buf])
        (dq,) = _return_rows(comm, [dq_s], dd)
        dk, dv = local_part(dk_buf, m, True).to(k.dtype), local_part(dv_buf, m, True).to(v.dtype)
        rk, rv = wait_dkv()
        # a token sent to several servers gets several dK/dV back: summed in fp32, its rows only
        add_rows(dk, dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rk)
        add_rows(dv, dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rv)
        return dq.to(q.dtype), dk, dv, None, None, None, None


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_AGREED: set = set()
"""Input signatures every rank of a group has already agreed on (checked once, then cached)."""


def check_inputs(q, k, v, n_local: int, attn_backend: str | None, group) -> str:
    """Validate this rank's inputs BEFORE any collective, identically on every rank (a rank that serves
    no task must fail as loudly as one that does), and return the resolved attention backend.

    Checks: ``q [n_local, Hq, D]``, ``k, v [n_local, Hkv, D]``; one floating dtype (float32, float16,
    bfloat16) and one device; ``Hq`` a multiple of ``Hkv``; the backend available for that dtype. The
    first time a signature ``(dtype, Hq, Hkv, D, backend)`` is seen on a group, the ranks compare it
    with one small all-gather (a one-off host synchronisation, never repeated for that signature), so
    ranks that disagree raise together instead of hanging in the first all-to-all."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [n_local, heads, head_dim]; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} has dtype {t.dtype}; cad_attention takes float32, float16 or bfloat16")
        if t.shape[0] != n_local:
            raise ValueError(f"{name} has {t.shape[0]} rows, but this rank holds n_local={n_local} tokens "
                             "of the plan's layout (its tokens in layout order)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[2] < 1:
        raise ValueError(f"q and k must share head_dim >= 1; got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    backend = resolve_backend(attn_backend, q.device, q.dtype, q.shape[2])
    sig = (str(q.dtype), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), backend)
    if dist.is_initialized() and (id(group), sig) not in _AGREED:
        seen: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, sig, group=group)
        if any(s != sig for s in seen):
            raise ValueError("the ranks disagree on (dtype, query heads, KV heads, head_dim, attention "
                             f"backend): {seen}; every rank must call cad_attention with the same kind of "
                             "tensors")
        _AGREED.add((id(group), sig))
    return backend


def prepare(plan: Plan | Dispatch, group, device) -> DeviceDispatch:
    """This rank's dispatch for ``plan`` on ``device``: built once per plan (cached on the plan
    object, which must not change afterwards) so every layer of a step reuses the host metadata and
    the device index tensors."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if isinstance(plan, Dispatch):
        d = plan
    elif isinstance(plan, Plan):
        cache = plan.__dict__.setdefault("_cad_dispatch", {})    # not a dataclass field: never serialised
        if rank not in cache:
            cache[rank] = build_dispatch(plan, rank)
        d = cache[rank]
    else:
        raise ValueError(f"plan must be a cadlib.core.plan.Plan or a cadlib.dispatch.meta.Dispatch, got "
                         f"{type(plan).__name__}")
    if d.world != world or d.rank != rank:
        raise ValueError(f"the plan is for rank {d.rank} of {d.world} but this process is rank {rank} "
                         f"of a group of {world}; build the plan for the group you pass")
    return to_device(d, device)


def cad_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan | Dispatch, group,
                  attn_backend: str | None = None, comm=None, return_lse: bool = False,
                  kv_share: str | None = None):
    """Causal core attention of the local packed tokens, computed on the plan's attention servers.

    ``o_i = sum_{j <= i, same doc} softmax_j(q_i . k_j / sqrt(D)) v_j`` for every local token ``i``.
    ``group`` is the process group whose ranks are the plan's ranks (``None`` = the default group,
    only when you pass it). ``comm`` replaces the all-to-all (an object with
    ``start(send, send_splits, recv_splits, fill=None).wait() -> recv``, where ``fill(n)`` makes ``n``
    rows like the received ones from local rows, for a control that moves no bytes; default
    :class:`AllToAll` on ``group``).
    ``kv_share``: the server's KV layout, ``"merged"`` (default) or ``"copy"`` (:mod:`cadlib.runtime.server`).
    A re-ordered plan (``cadlib.scheduling.sentlast.sent_last(plan).plan``, whose donors read in place) works as
    any other: each rank then passes its tokens in that plan's layout order. Returns ``o`` (and the
    float32 ``lse [n_local, Hq]`` with ``return_lse``)."""
    kv_share = check_mode(kv_share)
    dd = prepare(plan, group, q.device)
    attn_backend = check_inputs(q, k, v, dd.meta.n_local, attn_backend, group)
    o, lse = CADAttention.apply(q, k, v, dd, comm if comm is not None else AllToAll(group),
                              attn_backend, kv_share)
    return (o, lse) if return_lse else o
