"""Core attention disaggregation as three autograd stages: ``cad_attention(q, k, v, plan, group)``.

Each rank passes its local packed tokens (the linear layout: ``layout.ranks[rank]``'s chunks in
order), q ``[n_local, Hq, D]`` and k, v ``[n_local, Hkv, D]``, and gets back its attention output
``o [n_local, Hq, D]``, as if every document had run causal attention on one device. Every GPU is an
attention server, in place. The data path of one layer (``R`` ranks, each a home of tokens and a
server)::

    forward
      send   (comm)     home  q[q_send_index]        --all_to_all(Q)-->         q_buf = [q ; recv]
                        owner [k, v][kv_send_index]  --all_to_all(KV, dedup)--> kv_buf = [kv ; recv]
      serve  (compute)  server out, lse = attend(q_buf[q_rows], k_buf[kv_rows], v_buf[kv_rows])  ONE call
      return (comm)     server out[ret_rows]         --all_to_all(O)-->         home o[q_send_index]
                                 self-served rows stay: o[self_local] = out[self_rows]
      the server keeps its buffers, out and lse for the backward
    backward (the stages in mirror order)
      return' home  dO[q_send_index]                 --all_to_all-->            server dout rows
      serve'  server dq, dk, dv = attend_backward(...)                            ONE call
                     dk_buf = dK summed per KV row (fp32 only where rows are shared: cadlib.dispatch.kvshare)
      send'   server dq of received rows             --all_to_all-->            home dq[q_send_index] +=
              server [dk, dv] of received KV rows    --all_to_all-->            owner dk[kv_send_index] +=

DistCA's servers are stateless: its backward resends q, k, v, o, dO and LSE. Here a server keeps what
it received until the backward, which then moves only dO out and dQ, dK, dV back: half the bytes,
for server memory equal to the rows it received. On a sent-last plan (:mod:`cadlib.scheduling.sentlast`)
the dispatch may lay a server's buffers out received first (:class:`cadlib.dispatch.meta.Dispatch`);
the stages read that layout through :mod:`cadlib.runtime.buffers`.

The stages are separate autograd nodes so that two nano-batches can overlap (:mod:`cadlib.runtime.pingpong`):
:func:`send` and :func:`ret` run on the communication stream, :func:`serve` on the compute stream. A
stage's backward runs on the stream that was current when it was applied (autograd's rule for CUDA),
and autograd makes a node's stream wait for the streams that produced its gradients. Tensors that
cross streams are kept alive for the stream that uses them (``record_stream``). Nothing here reads a
device value on the host. On CPU there are no streams: the same code runs in program order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.plan import Plan
from ..dispatch.build import build_dispatch
from ..dispatch.kvshare import check_mode
from ..dispatch.meta import Dispatch
from .buffers import kv_rows_cat, local_part, recv_part, send_rows, server_rows, to_home
from .comm import AllToAll, exchange
from .device import DeviceDispatch, to_device
from .kernels import resolve_backend
from .server import add_rows, serve_backward, serve_forward
from .streams import OFF, Streams, Timeline

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


# ------------------------------------------------------------------------------ the data movements
# Plain functions (no autograd): the stages below wrap them, and the stateless servers of a pipeline's
# lock-step ticks (cadlib.runtime.resend) call them directly.

def to_servers(comm, q_parts, kv_parts, dd: DeviceDispatch):
    """Homes and owners to servers: per-query tensors ``q_parts`` and per-KV-row tensors ``kv_parts``
    (this rank's rows, in its layout order) travel in two all-to-alls; returns the server buffers,
    ``cat([local[:q_keep], received])`` for each query part and ``cat([local, received])`` for each
    KV part."""
    m = dd.meta
    wait_q = send_rows(comm, q_parts, dd)
    wait_kv = exchange(comm, kv_parts, dd.kv_send_index, m.kv_send_splits, m.kv_recv_splits, m.kv_traffic)
    q_recv, kv_recv = wait_q(), wait_kv()
    return ([server_rows(p, r, m) for p, r in zip(q_parts, q_recv)],
            [kv_rows_cat(p, r, m) for p, r in zip(kv_parts, kv_recv)])


def rows_home(comm, rows, dd: DeviceDispatch):
    """Servers to homes: per-query tensors in task-row order (O, LSE) back to the ranks their
    queries live on; returns each as ``[n_local, ...]``."""
    m = dd.meta
    if m.q_identity:       # kept rows first, in order; received ones go back unpermuted
        back = exchange(comm, [recv_part(r, m) for r in rows], None, m.q_recv_splits, m.q_send_splits,
                        m.q_traffic, source=rows)()
    else:
        back = exchange(comm, rows, dd.ret_rows, m.q_recv_splits, m.q_send_splits, m.q_traffic)()
    return [to_home(r, b, dd) for r, b in zip(rows, back)]


def query_buffer(rows_t, q_buf, dd: DeviceDispatch):
    """Task-row-ordered rows (a server's dQ) laid out like its query buffer ``q_buf`` (zeros where a
    buffer row is in no task)."""
    if dd.meta.q_identity:
        return rows_t
    return torch.zeros_like(q_buf, dtype=rows_t.dtype).index_copy_(0, dd.q_rows, rows_t)


def grads_home(comm, dq_buf, dk_buf, dv_buf, dd: DeviceDispatch):
    """The reverse of :func:`to_servers` for gradients: the servers' dQ of received rows back to
    their homes and dK, dV of received KV rows back to their owners, added to the rows each rank
    computed itself (a KV row sent to several servers gets every server's part). Returns
    ``(dq, dk, dv)`` for this rank's ``n_local`` rows."""
    m = dd.meta
    n = m.n_local
    wait_q = exchange(comm, [recv_part(dq_buf, m)], None, m.q_recv_splits, m.q_send_splits,
                      m.q_traffic, source=[dq_buf])
    wait_kv = exchange(comm, [recv_part(dk_buf, m, True), recv_part(dv_buf, m, True)], None,
                       m.kv_recv_splits, m.kv_send_splits, m.kv_traffic, source=[dk_buf, dv_buf])
    (rq,) = wait_q()
    rk, rv = wait_kv()
    # rows of this rank served elsewhere get their gradients added (on a copy: the buffer's
    # gradient is autograd's); a sent-last rank's are its tail (to_home); with nothing sent
    # and every row served here, the local part is the gradient as it is
    if m.q_identity and m.q_keep < n:
        dq = to_home(dq_buf, rq, dd)
    else:
        dq_l = local_part(dq_buf, m)
        dq = dq_l.clone().index_add_(0, dd.q_send_index, rq) if m.n_send_q else dq_l
    dk_l, dv_l = local_part(dk_buf, m, True), local_part(dv_buf, m, True)
    if m.n_send_kv:
        dk = add_rows(dk_l.clone(), dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rk)
        dv = add_rows(dv_l.clone(), dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rv)
    else:
        dk, dv = dk_l, dv_l
    return dq, dk, dv


# ------------------------------------------------------------------------------ the autograd stages
class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dd: DeviceDispatch, comm, streams: Streams, tl: Timeline, name: str):
        streams.keep((q, k, v), streams.comm)
        with streams.on_comm(), tl.span("comm", f"send {name}"):
            (q_buf,), (k_buf, v_buf) = to_servers(comm, [q], [k, v], dd)
            bufs = (q_buf, k_buf, v_buf)
        streams.keep(bufs, streams.compute)
        ctx.dd, ctx.comm, ctx.streams, ctx.tl, ctx.name = dd, comm, streams, tl, name
        return bufs

    @staticmethod
    def backward(ctx, dq_buf, dk_buf, dv_buf):
        streams = ctx.streams
        streams.keep((dq_buf, dk_buf, dv_buf), streams.comm)
        with ctx.tl.span("comm", f"send' {ctx.name}"):
            grads = grads_home(ctx.comm, dq_buf, dk_buf, dv_buf, ctx.dd)
        streams.keep(grads, streams.compute)
        return (*grads, None, None, None, None, None)


class _Serve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_buf, k_buf, v_buf, dd: DeviceDispatch, attn_backend, tl: Timeline, name: str,
                kv_share: str):
        with tl.span("compute", f"attn {name}"):
            out, lse = serve_forward(q_buf, k_buf, v_buf, dd, attn_backend, kv_share)
        ctx.save_for_backward(q_buf, k_buf, v_buf, out, lse)
        ctx.dd, ctx.attn_backend, ctx.tl, ctx.name, ctx.kv_share = dd, attn_backend, tl, name, kv_share
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_buf, k_buf, v_buf, out, lse = ctx.saved_tensors
        dd = ctx.dd
        with ctx.tl.span("compute", f"attn' {ctx.name}"):
            dq_t, dk, dv = serve_backward(q_buf, k_buf, v_buf, out, dout.contiguous(), lse, dd,
                                          ctx.attn_backend, ctx.kv_share)
            dq = query_buffer(dq_t.to(q_buf.dtype), q_buf, dd)
        return dq, dk.to(k_buf.dtype), dv.to(v_buf.dtype), None, None, None, None, None


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, dd: DeviceDispatch, comm, streams: Streams, tl: Timeline, name: str):
        rows = [out] if lse is None else [out, lse]
        streams.keep(rows, streams.comm)
        with streams.on_comm(), tl.span("comm", f"return {name}"):
            homes = rows_home(comm, rows, dd)
        streams.keep(homes, streams.compute)
        ctx.dd, ctx.comm, ctx.streams, ctx.tl, ctx.name = dd, comm, streams, tl, name
        ctx.n_rows = out.shape[0]
        if lse is None:
            return homes[0]
        ctx.mark_non_differentiable(homes[1])
        return tuple(homes)

    @staticmethod
    def backward(ctx, do, *_dlse):
        dd, m, streams = ctx.dd, ctx.dd.meta, ctx.streams
        streams.keep((do,), streams.comm)
        with ctx.tl.span("comm", f"return' {ctx.name}"):
            do = do.contiguous()
            (recv,) = send_rows(ctx.comm, [do], dd)()
            if m.q_identity:
                dout = server_rows(do, recv, m)
            else:
                dout = do.new_empty((ctx.n_rows, *do.shape[1:]))
                dout.index_copy_(0, dd.self_rows, do.index_select(0, dd.self_local))
                dout.index_copy_(0, dd.ret_rows, recv)
        streams.keep((dout,), streams.compute)
        return dout, None, None, None, None, None, None


def send(q, k, v, dd, comm, streams, tl=OFF, name=""):
    """Stage 1 (comm stream): q, k, v of this rank's tokens to their servers; returns the server
    buffers ``(q_buf, k_buf, v_buf)`` = ``cat([local, received])``.

    Applied with the comm stream current, so that autograd runs its backward there too (a node's
    backward runs on the stream that was current when it was applied) and makes the consumers of its
    gradients wait for that stream only when they run."""
    with streams.on_comm():
        return _Send.apply(q, k, v, dd, comm, streams, tl, name)


def serve(q_buf, k_buf, v_buf, dd, attn_backend=None, tl=OFF, name="", kv_share=None, with_lse=False):
    """Stage 2 (compute stream): this server's tasks in one fused call; returns O in task-row order
    (and the float32 LSE with ``with_lse``). ``kv_share``: the server's KV layout, ``"merged"`` (the
    default) or ``"copy"``, its reference (:mod:`cadlib.runtime.server`)."""
    out, lse = _Serve.apply(q_buf, k_buf, v_buf, dd, attn_backend, tl, name, check_mode(kv_share))
    return (out, lse) if with_lse else out


def ret(out, dd, comm, streams, tl=OFF, name="", lse=None):
    """Stage 3 (comm stream): O rows back to their homes; returns ``o [n_local, Hq, D]`` (with ``lse``,
    the servers' LSE rows travel with them: ``(o, lse [n_local, Hq])``). Applied on the comm stream,
    like :func:`send`."""
    with streams.on_comm():
        return _Return.apply(out, lse, dd, comm, streams, tl, name)


def cad_attention(q, k, v, plan: Plan | Dispatch, group, attn_backend: str | None = None, comm=None,
                  streams: Streams | None = None, tl: Timeline = OFF, name: str = "",
                  kv_share: str | None = None, return_lse: bool = False):
    """Causal core attention of the local packed tokens, computed on the plan's attention servers:
    send, serve and return in sequence (one nano-batch; :mod:`cadlib.runtime.pingpong` interleaves two).

    ``o_i = sum_{j <= i, same doc} softmax_j(q_i . k_j / sqrt(D)) v_j`` for every local token ``i``.
    ``group`` is the process group whose ranks are the plan's ranks (``None`` = the default group, or
    a single process). ``comm`` replaces the all-to-all (an object with ``start(send, send_splits,
    recv_splits, fill=None).wait() -> recv``, where ``fill(n)`` makes ``n`` rows like the received ones
    from local rows, for a control that moves no bytes; default :class:`cadlib.runtime.comm.AllToAll`
    on ``group``). ``streams``, ``tl`` and ``name``: the streams to run on and the timeline whose spans
    the stages record. ``kv_share``: the server's KV layout, ``"merged"`` (default) or ``"copy"``.
    A re-ordered plan (``cadlib.scheduling.sentlast.sent_last(plan).plan``, whose donors read in place)
    works as any other: each rank then passes its tokens in that plan's layout order. Returns ``o``
    (and the float32 ``lse [n_local, Hq]`` with ``return_lse``)."""
    kv_share = check_mode(kv_share)
    dd = prepare(plan, group, q.device)
    attn_backend = check_inputs(q, k, v, dd.meta.n_local, attn_backend, group)
    comm = comm if comm is not None else AllToAll(group)
    streams = streams if streams is not None else Streams(q.device)
    streams.barrier()
    bufs = send(q, k, v, dd, comm, streams, tl, name)
    streams.barrier()
    out, lse = serve(*bufs, dd, attn_backend, tl, name, kv_share, with_lse=True)
    streams.barrier()
    o = ret(out, dd, comm, streams, tl, name, lse if return_lse else None)
    streams.barrier()
    return o
