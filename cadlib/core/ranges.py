"""Range-encoded index arrays: the host computes runs of rows, the device expands them.

The dispatch's per-token index maps (the local rows a rank sends, the buffer rows each query and KV
token of the fused call reads, where the returned rows go) are concatenations of runs of consecutive
rows: a chunk's piece, a task's block in the received buffer, a document's prefix. Materialised on
the host they cost one int64 per token, and on DistCA's head/tail layout at 64 ranks x 512K tokens a
server's KV gather alone is 34M rows (1.7 s of numpy for one rank). So the host builds only the runs,
O(chunks + tasks), and the tokens are expanded where they are used:

* on the device (:class:`cadlib.runtime.device.DeviceIndex`): the runs of all of a dispatch's arrays travel in one host
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


def i64(a) -> np.ndarray:
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous:
        return a                                  # the same object: run arrays shared by id
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


class Ranges:
    """Runs ``[starts[i], starts[i] + lens[i])`` one after another (empty runs allowed)."""

    __slots__ = ("starts", "lens", "size", "_np")

    def __init__(self, starts, lens):
        self.starts, self.lens = i64(starts), i64(lens)
        if self.starts.shape != self.lens.shape:
            raise ValueError(f"starts and lens must have one length, got {self.starts.size} and "
                             f"{self.lens.size}")
        self.size = int(self.lens.sum())
        self._np = None

    @classmethod
    def from_array(cls, a) -> "Ranges":
        """The runs of consecutive values of an explicit index array (O(len(a)))."""
        a = i64(a)
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
