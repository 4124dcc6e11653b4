"""A dispatch on a device: the host's runs of rows copied once and expanded where they are used.

The host builds every per-token index map of a step as runs of consecutive rows
(:mod:`cadlib.core.ranges`, :mod:`cadlib.dispatch.build`). Here they reach the device:
:class:`DeviceIndex` copies the runs of all of a dispatch's arrays in ONE host buffer (pinned, one
``non_blocking`` copy on CUDA) and expands each array on first use by one vectorised expansion,
``repeat_interleave(start - offset, length) + arange``, whose output size the host knows, so it never
waits for the device. CPU tensors take the same path. :func:`to_device` gives a
:class:`DeviceDispatch`, the view the CAD stages read.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from ..core.ranges import Gather, Ranges, encoding, i64
from ..dispatch.kvshare import SHARED_NAMES, SharedKV
from ..dispatch.meta import INDEX_NAMES, Dispatch


def expand(starts, lens, size: int):
    """The device expansion of one :class:`Ranges` from its ``starts`` and ``lens`` tensors: the
    shifts by a cumulative sum, then one ``repeat_interleave`` (``output_size`` given, so no
    device->host synchronisation) plus ``arange``."""
    if not size:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    head = torch.cumsum(lens, 0).sub_(lens)
    out = torch.repeat_interleave(starts - head, lens, output_size=size)
    return out.add_(torch.arange(size, dtype=torch.int64, device=starts.device))


class DeviceIndex:
    """Named index arrays on one device. ``arrays`` maps a name to a :class:`Ranges` or
    :class:`Gather` (expanded on first use, cached; runs shared by several arrays, such as a KV map,
    are copied and expanded once) or to a small plain array copied as it is (``dtypes`` gives its
    torch dtype, default int64). All host data goes in ONE int64 buffer and one copy: pinned and
    ``non_blocking`` on CUDA (torch's caching host allocator keeps the pinned buffer alive until the
    copy has run). The host only concatenates the runs' arrays (a run array shared by two
    :class:`Ranges`, e.g. the lengths of the KV send runs and of their slots, goes once); the
    shifts are computed on the device."""

    def __init__(self, arrays: dict, device, dtypes: dict | None = None):
        self.arrays, self.dtypes = arrays, dict(dtypes or {})
        self._at: dict[int, tuple[int, int]] = {}        # id(host array) -> (offset, size) in the buffer
        self._plain: dict[str, tuple[int, int]] = {}
        parts, off = [], 0

        def put(x: np.ndarray) -> tuple[int, int]:
            nonlocal off
            parts.append(x)
            off += x.size
            return off - x.size, x.size

        for name, a in arrays.items():
            if isinstance(a, (Ranges, Gather)):
                for r in a.runs():
                    for x in (r.starts, r.lens):
                        if id(x) not in self._at:
                            self._at[id(x)] = put(x)
            else:
                self._plain[name] = put(i64(a))
        host = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        self.device = torch.device(device)
        self.flat = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
            else host.to(self.device)
        self._cache: dict = {}

    def _part(self, x: np.ndarray):
        off, n = self._at[id(x)]
        return self.flat[off:off + n]

    def _expand(self, r: Ranges):
        key = ("runs", id(r))
        if key not in self._cache:
            self._cache[key] = expand(self._part(r.starts), self._part(r.lens), r.size)
        return self._cache[key]

    def __getitem__(self, name: str):
        if name not in self._cache:
            a = self.arrays[name]
            if name in self._plain:
                off, n = self._plain[name]
                t = self.flat[off:off + n].to(self.dtypes.get(name, torch.int64))
            elif isinstance(a, Gather):
                t = self._expand(a.base).index_select(0, self._expand(a.index))
            else:
                t = self._expand(a)
            self._cache[name] = t
        return self._cache[name]


class DeviceSharedKV:
    """A :class:`SharedKV`'s arrays on one device, each expanded on first use (from ``index``, its own
    or its dispatch's, where its names carry ``prefix``)."""

    def __init__(self, meta: SharedKV, index: DeviceIndex, prefix: str = ""):
        self.meta, self.index, self.prefix = meta, index, prefix

    def __getattr__(self, name):
        if name in SHARED_NAMES or name in ("cu_q", "cu_k"):
            return self.index[self.prefix + name]
        raise AttributeError(name)



class _DeviceArray:
    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else obj.index[self.name]


class DeviceDispatch:
    """The index maps of a :class:`Dispatch` on one device, each expanded on first use (on the stream
    current then; no host synchronisation); split sizes stay on the host (``meta``)."""

    q_send_index = _DeviceArray()
    kv_send_index = _DeviceArray()
    q_rows = _DeviceArray()
    kv_rows = _DeviceArray()
    cu_q = _DeviceArray()
    cu_k = _DeviceArray()
    ret_rows = _DeviceArray()
    self_rows = _DeviceArray()
    self_local = _DeviceArray()
    kv_send_uniq = _DeviceArray()      # distinct rows of kv_send_index and each entry's slot among them:
    kv_send_slot = _DeviceArray()      # the owner sums several servers' dK/dV of one token (add_rows)

    def __init__(self, meta: Dispatch, index: DeviceIndex):
        self.meta, self.index, self._shared = meta, index, None

    @property
    def shared(self):
        """The merged call's device metadata (:class:`DeviceSharedKV`), copied with
        the dispatch's maps."""
        if self._shared is None:
            self._shared = DeviceSharedKV(self.meta.shared(), self.index, "shared.")
        return self._shared


def to_device(dispatch: Dispatch, device) -> DeviceDispatch:
    """The index maps of ``dispatch``, and its merged call's, on ``device`` (:class:`DeviceIndex`:
    their runs copied once per device, in one pinned ``non_blocking`` copy on CUDA, so the host never
    waits for the device and the next step's plan can be built meanwhile; each map expanded there on
    first use). The KV map that both calls read through travels once.

    The copy is cached on the dispatch; the returned view (which refers back to it) only weakly, so
    that no reference cycle keeps a finished step's device tensors alive until a full garbage
    collection: the same view while someone holds it, else a new view of the same copy."""
    cache = dispatch._device_cache
    key = str(device)
    view = cache.get(("view", key))
    if view is not None and view() is not None:
        return view()
    if key not in cache:
        arrays = {n: encoding(dispatch, n) for n in INDEX_NAMES} | {"cu_q": dispatch.cu_q,
                                                                    "cu_k": dispatch.cu_k}
        if dispatch.task_doc is not None:
            sh = dispatch.shared()
            arrays |= {f"shared.{n}": encoding(sh, n) for n in SHARED_NAMES}
            arrays |= {"shared.cu_q": sh.cu_q, "shared.cu_k": sh.cu_k}
        i32 = {n: torch.int32 for n in ("cu_q", "cu_k", "shared.cu_q", "shared.cu_k")}
        cache[key] = DeviceIndex(arrays, device, i32)
    dd = DeviceDispatch(dispatch, cache[key])
    cache[("view", key)] = weakref.ref(dd)
    return dd


def shared_to_device(shared: SharedKV, device) -> DeviceSharedKV:
    """A merged call's arrays alone on ``device`` (as :func:`to_device`; the copy cached on ``shared``,
    a new view of it per call, so that no reference cycle holds it)."""
    key = str(device)
    if key not in shared._device_cache:
        arrays = {n: encoding(shared, n) for n in SHARED_NAMES} | {"cu_q": shared.cu_q, "cu_k": shared.cu_k}
        shared._device_cache[key] = DeviceIndex(arrays, device, {"cu_q": torch.int32, "cu_k": torch.int32})
    return DeviceSharedKV(shared, shared._device_cache[key])
