"""Cutting a CA-task into query shards: the one cutter (the scheduler's shards, reference and engine,
come from here).

A causal task ``[a, b)`` of a document carries ``sum_{i=a}^{b-1} (i + 1)`` attention pairs. A shard
cut from its end ``[b-k, b)`` or its start ``[a, a+k)`` carries ``k(2b + 1 - k) / 2`` or
``k(2a + 1 + k) / 2`` pairs; finding the ``k`` that carries a given number of pairs solves a
quadratic, done exactly in integers (:func:`tri_floor`, :func:`tri_ceil`).
"""
from __future__ import annotations

import math

import numpy as np

_TRI_EXACT = 2 ** 46


def tri_floor(v) -> np.ndarray:
    """Largest ``c >= 0`` with ``c(c+1) <= v`` (0 where ``v < 2``), exact for int64 ``v``:
    ``floor((sqrt(4v + 1) - 1) / 2)``. In float64 this is exact below ``2**46``: ``4v + 1`` is exact,
    at ``v = c(c+1)`` it is the square ``(2c+1)**2`` (correctly rounded sqrt is exact) and just below it
    the root is ``>= 1/(2c+1)`` under ``c``, far more than the rounding error; larger ``v`` get one
    integer correction step."""
    v = np.maximum(np.asarray(v, dtype=np.int64), 0)
    c = (np.sqrt(v + 0.25) - 0.5).astype(np.int64)    # sqrt(4v + 1) / 2: >= 0, truncation is floor
    if not v.size or v.max() < _TRI_EXACT:
        return c
    w = c * (c + 1)                                    # float sqrt is within one of exact here
    return c - (w > v) + (w + 2 * (c + 1) <= v)


def tri_ceil(v) -> np.ndarray:
    """Smallest ``c >= 0`` with ``c(c+1) >= v``: ``tri_floor(v - 1) + 1`` for ``v >= 1``, else 0."""
    v = np.asarray(v, dtype=np.int64)
    return tri_floor(v - 1) + (v >= 1)


def shard_pairs(a, b, k, from_end: bool):
    """Pairs of the end shard ``[b-k, b)`` (``k(2b + 1 - k) / 2``) or the start shard ``[a, a+k)``
    (``k(2a + 1 + k) / 2``) of task ``[a, b)``."""
    return (k * (2 * b + 1 - k)) // 2 if from_end else (k * (2 * a + 1 + k)) // 2


def cut_shards(a, b, x, y, min_shard: int, sides: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """How many query tokens ``k`` to cut from tasks ``[a, b)`` so that the shard carries at least
    ``x`` pairs and at most ``y`` (the receiver's room), for both sides at once: returns ``(k, pairs)``,
    each ``[2, N]``, row 0 the **end** shard ``[b-k, b)``, row 1 the **start** shard ``[a, a+k)``.

    A valid shard leaves both pieces ``>= min_shard`` tokens (``m <= k <= n - m``) or is the whole task
    (``k = n``). ``k`` is the fewest valid tokens with ``pairs >= x``; if that exceeds ``y``, the most
    valid tokens with ``pairs <= y`` instead; 0 if none. Causal pairs solve a quadratic: the end shard
    ``[c, b)`` has ``(b(b+1) - c(c+1)) / 2`` pairs, so the fewest tokens with ``>= x`` pairs are
    ``k = b - tri_floor(b(b+1) - 2x)``; the start shard ``[a, e)`` has ``(e(e+1) - a(a+1)) / 2``, so
    ``k = tri_ceil(a(a+1) + 2x) - a``; and with ``y``: ``b - tri_ceil(b(b+1) - 2y)``,
    ``tri_floor(a(a+1) + 2y) - a``. ``sides=1``: the end shard only (row 0)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    m, n = int(min_shard), b - a
    h = sides
    ab = np.concatenate((b, a, b, a) if h == 2 else (b, b)).reshape(2 * h, -1)
    sign, ceil = _SIGN[h], _CEIL[h]
    xy = np.empty_like(ab)
    xy[:h], xy[h:] = x, y
    # floor roots of b(b+1) - 2x, a(a+1) + 2y; ceiling roots (tri_ceil(v) = tri_floor(v - 1) + [v >= 1])
    # of a(a+1) + 2x, b(b+1) - 2y: one pass
    v = ab * (ab + 1) + _SIGN2[h] * xy - ceil
    r = (np.sqrt(np.maximum(v, 0) + 0.25) - 0.5).astype(np.int64)   # tri_floor(v), float path
    if v.size and v.max() >= _TRI_EXACT:
        r = tri_floor(v)
    r += ceil & (v >= 0)
    k = (r - ab) * sign                                # fewest (end, start), most (end, start)
    up = np.maximum(k[:h], m)                          # fewest valid tokens >= fewest
    np.copyto(up, n, where=up > n - m)
    dn = np.minimum(k[h:], n - m)                      # most valid tokens <= most
    dn *= dn >= m
    np.copyto(dn, n, where=k[h:] >= n)
    kk = np.concatenate((up, dn))                      # [up end, up start, down end, down start]
    p = (kk * (2 * ab + 1 + sign * kk)) >> 1           # end k(2b+1-k)/2, start k(2a+1+k)/2
    ok = p[:h] <= y
    return np.where(ok, up, dn), np.where(ok, p[:h], p[h:])


def cut_near(a: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, min_shard: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`cut_shards` (both sides) when ``1 <= x <= y + 1``, as the engine's moves have them (``x``
    is the ceiling of at most the room, ``y`` its floor), from the fewest-token roots alone: the most
    tokens with at most ``y`` pairs are then one less than the fewest with at least ``x``
    (``pairs(kf - 1) < x <= y + 1``), wherever ``cut_shards`` falls back to them (the fewest valid
    tokens, ``max(kf, m)`` or the whole task, carry more than ``y``). Half the roots and a dozen fewer
    numpy calls. ``a, b, x, y``: int64 arrays; returns ``(k, pairs)``, each ``[2, N]`` (end, start)."""
    m = int(min_shard)
    n = b - a
    ab = np.concatenate((b, a)).reshape(2, -1)
    v = ab * (ab + 1)                                  # end: b(b+1) - 2x; start: a(a+1) + 2x - 1
    v += _NEAR_X * x
    v -= _NEAR_C
    r = (np.sqrt(np.maximum(v, 0) + 0.25) - 0.5).astype(np.int64)
    if v.size and v.max() >= _TRI_EXACT:
        r = tri_floor(v)
    kf = r - ab                                        # fewest tokens with >= x pairs: b - r, r + 1 - a
    kf *= _NEAR_SIGN
    kf += _NEAR_C
    nm = n - m
    up = np.maximum(kf, m)                             # fewest valid tokens
    np.copyto(up, n, where=up > nm)
    dn = np.minimum(kf - 1, nm)                        # most valid tokens with <= y pairs
    dn *= dn >= m
    t = 2 * ab + 1
    k = np.where((up * (t + _NEAR_SIGN * up)) >> 1 <= y, up, dn)
    return k, (k * (t + _NEAR_SIGN * k)) >> 1


def end_cut(a: int, b: int, x: int, y: int, m: int) -> tuple[int, int]:
    """``(k, pairs)`` of the end shard ``[b-k, b)`` of task ``[a, b)`` that ``cut_shards`` picks (row
    0, same rules: at least ``x`` pairs with the fewest valid tokens, else the most with at most
    ``y``), in exact integer arithmetic; ``(0, -1)`` when it is not a valid move (``k == 0``, more
    than ``y`` pairs, or the task's smallest valid move above ``y``)."""
    n, bb = b - a, b * (b + 1)
    v = bb - 2 * x
    up = b - ((math.isqrt(4 * v + 1) - 1) // 2 if v > 0 else 0)      # fewest tokens with >= x pairs
    if up < m:
        up = m
    if up > n - m:
        up = n
    k = up
    p = (k * (2 * b + 1 - k)) >> 1
    if p > y:                                          # most valid tokens with <= y pairs
        v = bb - 2 * y - 1
        raw = b - ((math.isqrt(4 * v + 1) - 1) // 2 + 1 if v >= 0 else 0)
        k = min(raw, n - m)
        if k < m:
            k = 0
        if raw >= n:
            k = n
        p = (k * (2 * b + 1 - k)) >> 1
    e = a + m if n >= 2 * m else b                     # the smallest valid move: m start tokens
    if k <= 0 or p > y or (e * (e + 1) - a * (a + 1)) // 2 > y:
        return 0, -1
    return k, p


# rows fewest (end, start), most (end, start): the end shard counts down from b, the start one up from a
_SIGN = {2: np.array([[-1], [1], [-1], [1]]), 1: np.array([[-1], [-1]])}
_SIGN2 = {h: 2 * s for h, s in _SIGN.items()}
_CEIL = {2: np.array([[0], [1], [1], [0]]), 1: np.array([[0], [1]])}
_NEAR_X, _NEAR_C, _NEAR_SIGN = np.array([[-2], [2]]), np.array([[0], [1]]), np.array([[-1], [1]])


def _rows(*arrays) -> np.ndarray:
    """``np.stack`` of equal-length 1-d arrays (faster for small arrays)."""
    return np.concatenate(arrays).reshape(len(arrays), -1)
