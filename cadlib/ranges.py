"""Range-encoded index arrays: the host computes runs of rows, the device expands them.

The dispatch's per-token index maps (the local rows a rank sends, the buffer rows each query and KV
token of the fused call reads, where the returned rows go) are concatenations of runs of consecutive
rows: a chunk's piece, a task's block in the received buffer, a document's prefix. Materialised on
the host they cost one int64 per token, and on DistCA's head/tail layout at 64 ranks x 512K tokens a
server's KV gather alone is 34M rows (1.7 s of numpy for one rank). So the host builds only the runs,
O(chunks + tasks), and the tokens are expanded where they are used:

* on the device (:class:`DeviceIndex`): the runs of all of a dispatch's arrays travel in one host
  buffer (pinned, one ``non_blocking`` copy on CUDA) and each array is expanded on first use by one
  vectorised expansion, ``repeat_interleave(start - offset, length) + arange``, whose output size
  the host knows, so it never waits for the device. CPU tensors take the same path;
* on the host (:meth:`Ranges.numpy`), only for host consumers (tests, the in-process exchange
  simulation, accounting): see :class:`IndexArray`.

:class:`Ranges` is ``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])``; :class:`Gather`
is ``base[index]`` of two of them. A task's KV segment is a document's prefix read through the map
from that document's positions to KV-buffer rows: one run of the index per task and one run of the
map per chunk piece, instead of one run per (task, piece).

The run builders' shared helpers live here too (:func:`excl`, :func:`ragged`, :func:`group_max`,
:func:`small`): grouping by sorting combined integer keys, never ``np.lexsort`` or ``np.maximum.at``,
which are 20-100x slower on the 270K chunks of a head/tail layout.
"""
from __future__ import annotations

import numpy as np


def _i64(a) -> np.ndarray:
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous:
        return a                                  # the same object: run arrays shared by id
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


class Ranges:
    """Runs ``[starts[i], starts[i] + lens[i])`` one after another (empty runs allowed)."""

    __slots__ = ("starts", "lens", "size", "_np")

    def __init__(self, starts, lens):
        self.starts, self.lens = _i64(starts), _i64(lens)
        if self.starts.shape != self.lens.shape:
            raise ValueError(f"starts and lens must have one length, got {self.starts.size} and "
                             f"{self.lens.size}")
        self.size = int(self.lens.sum())
        self._np = None

    @classmethod
    def from_array(cls, a) -> "Ranges":
        """The runs of consecutive values of an explicit index array (O(len(a)))."""
        a = _i64(a)
        heads = np.flatnonzero(np.r_[True, np.diff(a) != 1]) if a.size else a
        return cls(a[heads], np.diff(np.r_[heads, a.size]))

    def shifts(self) -> np.ndarray:
        """``starts`` minus each run's offset in the output: the expansion adds ``arange(size)``."""
        return self.starts - excl(self.lens)

    def numpy(self) -> np.ndarray:
        """The expanded array on the host (computed once)."""
        if self._np is None:
            out = np.repeat(self.shifts(), self.lens) + np.arange(self.size) if self.size else self.starts[:0]
            out.flags.writeable = False
            self._np = out
        return self._np

    def is_identity(self, n: int) -> bool:
        """Whether the expansion is ``arange(n)`` (O(runs))."""
        return self.is_arange(0, n)

    def is_arange(self, start: int, n: int) -> bool:
        """Whether the expansion is ``arange(start, start + n)`` (O(runs))."""
        return self.size == n and bool(np.all((self.shifts() == start) | (self.lens == 0)))

    def runs(self) -> list["Ranges"]:
        return [self]


class Gather:
    """``base[index]``: the expansion of ``index`` picks positions of the expansion of ``base``."""

    __slots__ = ("base", "index", "size")

    def __init__(self, base: Ranges, index: Ranges):
        self.base, self.index, self.size = base, index, index.size

    def numpy(self) -> np.ndarray:
        out = self.base.numpy()[self.index.numpy()]
        out.flags.writeable = False
        return out

    def runs(self) -> list[Ranges]:
        return [self.base, self.index]


# -- vectorised helpers the run builders share (no Python loop over items) ------------------------------

def excl(x: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum."""
    return np.cumsum(x) - x


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of ``counts`` items: each item's group and its index within the group."""
    grp = np.repeat(np.arange(counts.size), counts)
    return grp, np.arange(grp.size) - np.repeat(excl(counts), counts)


def group_max(group: np.ndarray, value: np.ndarray, big: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``group`` keys (ascending) and the largest ``value`` (< ``big``) of each: one sort of
    ``group * big + value`` (a scattered ``np.maximum.at`` is ~20x slower on 270K items; the stable
    sort merges the sorted runs that plan-ordered tasks form)."""
    k = group * big
    k += value
    k.sort(kind="stable")
    g = k // big
    last = np.r_[g[1:] != g[:-1], True] if k.size else np.zeros(0, dtype=bool)
    return g[last], k[last] - g[last] * big


def small(x: np.ndarray, n: int) -> np.ndarray:
    """``x`` (values in ``[0, n)``) as int16 when it fits: numpy's stable argsort is a radix sort there."""
    return x.astype(np.int16) if n < 2 ** 15 else x


def expand(starts, lens, size: int):
    """The device expansion of one :class:`Ranges` from its ``starts`` and ``lens`` tensors: the
    shifts by a cumulative sum, then one ``repeat_interleave`` (``output_size`` given, so no
    device->host synchronisation) plus ``arange``."""
    import torch

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
        import torch

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
                self._plain[name] = put(_i64(a))
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
            import torch

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


class IndexArray:
    """A per-token index array held range-encoded in ``obj.index[name]``. Reading it gives the host
    array, expanded on first read and cached, read-only (edit a copy and assign it). Assigning an
    array (e.g. a test corrupting a dispatch on purpose) replaces the encoding and drops the object's
    device copies; ``obj.encoding(name)`` is what the device copy expands."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if self.name not in obj._host:
            obj._host[self.name] = obj.index[self.name].numpy()
        return obj._host[self.name]

    def __set__(self, obj, value):
        obj._host[self.name] = value = np.asarray(value)
        obj._explicit.add(self.name)
        obj._device_cache.clear()


def encoding(obj, name: str):
    """What ``obj.<name>`` expands from: its runs, or the runs of an array assigned to it."""
    return Ranges.from_array(obj._host[name]) if name in obj._explicit else obj.index[name]
