"""Range-encoded dispatch metadata (cadlib.core.ranges): the runs expand, on the host and with torch, to
exactly the per-token arrays the dispatch used to materialise.

:func:`reference_dispatch` builds every index map of one rank token by token from the layout's owner
map, as the module docstring of :mod:`cadlib.dispatch.build` defines them (the old implementation's
semantics, call order included); :func:`check_rank` compares them, and the merged call's arrays of
:func:`cadlib.dispatch.kvshare.build_shared` (per token) with :func:`cadlib.dispatch.kvshare.build_shared_runs`, on
scattered random layouts, DistCA head/tail (zigzag) layouts and layouts with empty ranks and pieces."""
import numpy as np
import pytest
import torch
from helpers import random_scattered_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan, layout_to_tasks, merge_groups
from cadlib.core.ranges import Gather, Ranges
from cadlib.data.packing import per_doc_zigzag_layout
from cadlib.dispatch.build import build_dispatch, local_index_map
from cadlib.dispatch.kvshare import SHARED_NAMES, build_shared
from cadlib.dispatch.meta import INDEX_NAMES
from cadlib.runtime.device import DeviceIndex, expand, shared_to_device, to_device


def naive(starts, lens) -> np.ndarray:
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)] + [np.zeros(0, np.int64)])


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-5, 50), st.integers(0, 6)), max_size=12))
def test_runs_expand_like_concatenated_aranges(runs):
    starts, lens = [s for s, _ in runs], [n for _, n in runs]
    r = Ranges(starts, lens)
    want = naive(starts, lens)
    assert r.size == want.size and np.array_equal(r.numpy(), want)
    assert np.array_equal(expand(torch.as_tensor(r.starts), torch.as_tensor(r.lens), r.size).numpy(), want)
    back = Ranges.from_array(want)
    assert np.array_equal(back.numpy(), want) and np.all(back.lens > 0)
    assert r.is_identity(want.size) == np.array_equal(want, np.arange(want.size))
    base = Ranges([100, 7], [5, 40])                            # positions 0..44 of some map
    at = [min(max(s, 0), 44) for s in starts]
    idx = Ranges(at, [min(n, 45 - x) for x, n in zip(at, lens)])
    g = Gather(base, idx)
    assert np.array_equal(g.numpy(), base.numpy()[idx.numpy()])
    dev = DeviceIndex({"g": g, "r": r, "plain": np.array([3, 1], np.int64)}, "cpu", {"plain": torch.int32})
    assert np.array_equal(dev["g"].numpy(), g.numpy()) and np.array_equal(dev["r"].numpy(), want)
    assert dev["plain"].dtype == torch.int32 and dev["plain"].tolist() == [3, 1]


def _lpt(served, plan):
    """The old call order: lexsort by (doc, q_start), merge groups longest prefix first."""
    doc, a, b = plan.doc, plan.q_start, plan.q_end
    s = served[np.lexsort((a[served], doc[served]))]
    if not s.size:
        return s
    g = merge_groups(doc[s], a[s], b[s])
    last = np.r_[np.flatnonzero(np.diff(g)), g.size - 1]
    return s[np.lexsort((a[s], g, -b[s][last][g]))]


def reference_dispatch(plan: Plan, r: int) -> dict:
    """Rank ``r``'s per-token maps, token by token (numpy per task / per (server, doc))."""
    lay = plan.layout
    lidx, owner = local_index_map(lay), lay.owner_map()
    doc, a, b = plan.doc.tolist(), plan.q_start.tolist(), plan.q_end.tolist()
    home, server = plan.home.tolist(), plan.server.tolist()
    T = range(len(doc))
    n_local = int(lay.tokens_per_rank()[r])
    mine = sorted((t for t in T if home[t] == r and server[t] != r), key=lambda t: server[t])
    out = {"q_send_index": np.concatenate([lidx[doc[t]][a[t]:b[t]] for t in mine] + [naive([], [])])}
    remote = sorted((t for t in T if server[t] == r and home[t] != r), key=lambda t: home[t])
    recv, pos = {}, n_local
    for t in remote:
        recv[t], pos = pos, pos + b[t] - a[t]
    n_buf = pos

    def rows(order):
        return np.concatenate([lidx[doc[t]][a[t]:b[t]] if home[t] == r else recv[t] + np.arange(b[t] - a[t])
                               for t in order] + [naive([], [])])

    served = _lpt(np.array([t for t in T if server[t] == r], dtype=np.int64), plan)
    q_rows = rows(served)
    if not mine and q_rows.size == n_buf and n_buf:            # the buffer-order exception
        buf = sorted(served.tolist(), key=lambda t: lidx[doc[t]][a[t]] if home[t] == r else recv[t])
        if np.array_equal(rows(buf), np.arange(n_buf)) and \
                merge_groups(plan.doc[buf], plan.q_start[buf], plan.q_end[buf])[-1] == \
                merge_groups(plan.doc[served], plan.q_start[served], plan.q_end[served])[-1]:
            served, q_rows = np.array(buf, dtype=np.int64), rows(buf)
    out["q_rows"] = q_rows
    need: dict = {}
    for t in T:
        need[server[t], doc[t]] = max(need.get((server[t], doc[t]), 0), b[t])
    send = [lidx[d][:e][owner[d][:e] == r] for (s, d), e in sorted(need.items()) if s != r]
    out["kv_send_index"] = np.concatenate(send + [naive([], [])])
    kvpos = {d: np.full(e, -1) for (s, d), e in need.items() if s == r}
    nxt = n_local
    for o in range(lay.n_ranks):
        for d in sorted(kvpos):
            held = owner[d][:kvpos[d].size] == o
            if o == r:
                kvpos[d][held] = lidx[d][:kvpos[d].size][held]
            else:
                kvpos[d][held] = nxt + np.arange(int(held.sum()))
                nxt += int(held.sum())
    out["kv_rows"] = np.concatenate([kvpos[doc[t]][:b[t]] for t in served] + [naive([], [])])
    is_remote = q_rows >= n_local
    ret = np.empty(int(is_remote.sum()), dtype=np.int64)
    ret[q_rows[is_remote] - n_local] = np.flatnonzero(is_remote)
    out.update(ret_rows=ret, self_rows=np.flatnonzero(~is_remote), self_local=q_rows[~is_remote])
    out["kv_send_uniq"], out["kv_send_slot"] = np.unique(out["kv_send_index"], return_inverse=True)
    out["tasks"], out["n_kv_buf"] = served.tolist(), nxt
    return out


def check_rank(plan: Plan, r: int) -> None:
    d = build_dispatch(plan, r)
    ref = reference_dispatch(plan, r)
    assert d.tasks == ref["tasks"]
    assert d.n_local + d.n_recv_kv == ref["n_kv_buf"]
    dev = to_device(d, "cpu")
    for name in INDEX_NAMES:
        assert np.array_equal(getattr(d, name), ref[name]), name
        assert np.array_equal(getattr(dev, name).numpy(), ref[name]), name
    # the merged call: runs of the KV map vs the per-token reference on the same per-task arrays
    got = d.shared()
    want = build_shared(d.task_doc, d.task_start, d.task_end, d.cu_q, d.cu_k, ref["kv_rows"], ref["n_kv_buf"])
    for f in ("cu_q", "cu_k", "group"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    for f in ("max_q", "max_k", "kv_identity", "all_once", "split_docs"):
        assert getattr(got, f) == getattr(want, f), f
    sdev = shared_to_device(got, "cpu")
    for name in SHARED_NAMES:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert np.array_equal(getattr(sdev, name).numpy(), getattr(want, name)), name


def scattered_tasks(layout: Layout, seed: int) -> Plan:
    """Each chunk cut into up to 4 tasks on random servers."""
    rng = np.random.default_rng(seed)
    tasks = []
    for t in layout_to_tasks(layout):
        cuts = np.unique(rng.integers(t.q_start + 1, t.q_end, size=rng.integers(0, 4))) if t.n_q > 1 else []
        bounds = [t.q_start, *[int(c) for c in cuts], t.q_end]
        for x, y in zip(bounds[:-1], bounds[1:]):
            srv = t.home if rng.random() < 0.4 else int(rng.integers(layout.n_ranks))
            tasks.append(CATask(t.doc, x, y, t.home, srv))
    rng.shuffle(tasks)
    return Plan(layout, tasks)


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts_match_per_token_reference(seed):
    plan = random_scattered_plan(seed, 1 + seed % 5)                      # some ranks empty, chunks scattered
    for r in range(plan.layout.n_ranks):
        check_rank(plan, r)


@pytest.mark.parametrize("seed", range(20))
def test_zigzag_layouts_match_per_token_reference(seed):
    rng = np.random.default_rng(100 + seed)
    R = int(rng.integers(1, 6))
    lens = rng.integers(1, 40, size=rng.integers(1, 6)).tolist()    # docs shorter than 2R: empty pieces
    layout = per_doc_zigzag_layout(lens, R)
    plans = [scattered_tasks(layout, seed), Plan(layout, layout_to_tasks(layout))]
    for plan in plans:
        for r in range(R):
            check_rank(plan, r)


def test_whole_local_buffer_cases_match_reference():
    # one local document read in place (kv_identity, q_identity) and an all-colocated rank next to
    # an empty one
    layout = Layout([[(0, 0, 64)]], [64])
    check_rank(Plan(layout, [CATask(0, x, x + 16, 0, 0) for x in range(0, 64, 16)]), 0)
    layout = Layout([[(0, 0, 6), (1, 0, 2)], [(2, 0, 10)], []], [6, 2, 10])
    plan = Plan(layout, [CATask(0, 0, 6, 0, 0), CATask(1, 0, 2, 0, 0), CATask(2, 0, 6, 1, 1),
                         CATask(2, 6, 8, 1, 0), CATask(2, 8, 10, 1, 2)])
    for r in range(3):
        check_rank(plan, r)


def test_assigned_maps_are_what_the_device_copies():
    """A map assigned on the host (a test corrupting a dispatch) is what ``to`` and ``shared`` use."""
    d = build_dispatch(random_scattered_plan(5, 2), 0)
    rows = d.kv_rows.copy()
    with pytest.raises(ValueError):
        d.kv_rows[0] = 0                                        # expanded maps are read-only
    d.kv_rows = rows
    rows[:2] = rows[:2][::-1].copy()                            # edited after assignment, before use
    assert np.array_equal(to_device(d, "cpu").kv_rows.numpy(), rows)
    want = build_shared(d.task_doc, d.task_start, d.task_end, d.cu_q, d.cu_k, rows, d.n_local + d.n_recv_kv)
    assert np.array_equal(d.shared().kv_rows, want.kv_rows)
