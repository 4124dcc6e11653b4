"""Batches as DistCA's end-to-end driver makes them: a stream of documents packed into **sequences** of
MaxDocLen tokens, and each step two batches of sequences (ping and pong).

The pipeline (our code, written from reading DistCA's ``tests/test_e2e_combined.py`` and
``distca/simulator/optimizers/samples.py``; its parameters are :data:`cadlib.core.paper.DISTCA_SAMPLER`):

1. **A document stream.** ``pretrain-distca`` and ``prolong-distca`` are DistCA's two samplers, applied to
   a corpus that stands in for DistCA's length files: as many documents as those files hold
   (:data:`~cadlib.core.paper.DISTCA_CORPUS_DOCS`) drawn from the matching table of
   :mod:`cadlib.data.workload` (whose percentiles are the files'). With ``T`` the raw threshold, ``u``
   the upsampling, ``f`` the share of short documents kept and ``e = MaxDocLen / 64K`` the elongation:

   * Pretrain: long documents (``x >= T``) repeated ``u`` times, the first ``f`` of the short ones kept,
     ``draw`` documents drawn from that pool without replacement (random order), every length times ``e``;
   * ProLong: the same pool, each long document set to ``64K x e`` tokens with probability ``r`` (else
     kept as it is, not elongated), the long ones first and then the short ones, in corpus order (no
     shuffle: the first steps hold long documents only).

   Any other distribution of :mod:`cadlib.data.workload` gives a stream of independent draws. When a
   stream runs out before a step is filled, the next one is drawn with the next seed (DistCA's driver
   stops there instead).
2. **Sequences** (:func:`pack_sequences`, DistCA's ``batch_documents``): documents in stream order, each
   rounded up to a multiple of 16 tokens, fill sequences of ``seq_len`` tokens; a document that does not
   fit in what is left is cut there and its remainder opens the next sequence as a document of its own.
3. **Steps** (:func:`step_sequences`): step ``b`` takes the next ``2B`` sequences; the first ``B`` form
   nano-batch A (ping) and the rest B (pong) (:func:`cadlib.scheduling.nanosplit.distca_layout`).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..core.paper import DISTCA_CORPUS_DOCS, DISTCA_SAMPLER
from .workload import sample_docs, sample_kwargs

SAMPLERS = {"pretrain-distca": "pretrain", "prolong-distca": "prolong"}
"""DistCA's samplers by name, each with the workload table its corpus is drawn from."""
SEQUENCES_PER_STREAM = 64
"""Sequences of one stream of independent draws (any other distribution), before the next seed's."""


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or int(v) != v or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def pack_sequences(docs, seq_len: int, multiple_of: int = 1) -> list[list[int]]:
    """DistCA's ``batch_documents``: documents in order fill sequences of ``seq_len`` tokens, each first
    rounded up to a multiple of ``multiple_of``; one that does not fit is cut where the sequence ends and
    the rest opens the next sequence. Every sequence but the last holds exactly ``seq_len`` tokens."""
    seq_len, multiple_of = _positive_int("seq_len", seq_len), _positive_int("multiple_of", multiple_of)
    out: list[list[int]] = []
    cur: list[int] = []
    room = seq_len
    for n in docs:
        n = -(-int(n) // multiple_of) * multiple_of
        if n < 1:
            raise ValueError(f"document lengths must be >= 1, got {n}")
        while n:
            take = min(n, room)
            cur.append(take)
            n, room = n - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], seq_len
    if cur:
        out.append(cur)
    return out


def elongation(seq_len: int) -> int:
    """DistCA's elongation factor of a MaxDocLen: ``max(1, seq_len // 64K)`` (``run4d.sh``)."""
    return max(1, int(seq_len) // DISTCA_SAMPLER["elongate_unit"])


def corpus(table: str, seed: int) -> np.ndarray:
    """A stand-in for DistCA's length file of ``table``: as many documents as it holds, drawn from the
    table (:func:`cadlib.data.workload.sample_docs` fills a token budget: asked for enough, the first
    ``n`` are kept, so they are independent draws)."""
    n, mean, out = DISTCA_CORPUS_DOCS[table], 8192, []
    while len(out) <= n:
        out = sample_docs(table, 2 * n * mean, seed=seed)
        mean *= 2
    return np.asarray(out[:n], dtype=np.int64)


def distca_stream(sampler: str, seq_len: int, seed: int) -> list[int]:
    """The document stream of DistCA's ``sampler`` for sequences of ``seq_len`` tokens (module docstring)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
    c = DISTCA_SAMPLER
    docs = corpus(SAMPLERS[sampler], seed)
    e = elongation(seq_len)
    long_, short = docs[docs >= c["filter_threshold"]], docs[docs < c["filter_threshold"]]
    short = short[:int(len(short) * c["filter_ratio"])]
    long_ = np.tile(long_, c["upsample"])
    rng = np.random.default_rng(seed)
    if sampler == "pretrain-distca":
        pool = np.concatenate([short, long_])
        return (rng.choice(pool, size=min(c["draw"], pool.size), replace=False) * e).tolist()
    change = rng.random(long_.size) < c["change_long_doc_ratio"]
    long_ = np.where(change, c["elongate_unit"] * e, long_)
    return np.concatenate([long_, short]).tolist()


@lru_cache(maxsize=32)
def _sequences(dist: str, seq_len: int, seed: int, part: int, length: int | None) -> tuple[tuple[int, ...], ...]:
    """Part ``part`` of the sequences of ``dist`` (the stream drawn with seed ``seed + part``; ``length``:
    the documents of ``uniform``)."""
    if dist in SAMPLERS:
        stream = distca_stream(dist, seq_len, seed + part)
    else:
        kw = sample_kwargs(dist)
        if kw["dist"] == "uniform":
            kw["length"] = length or seq_len
        stream = sample_docs(kw.pop("dist"), SEQUENCES_PER_STREAM * seq_len, seed=seed + part, **kw)
    seqs = pack_sequences(stream, seq_len, DISTCA_SAMPLER["multiple_of"] if dist in SAMPLERS else 1)
    if len(seqs[-1]) and sum(seqs[-1]) < seq_len:
        seqs = seqs[:-1]                          # a stream's last, partial sequence is never used
    return tuple(tuple(s) for s in seqs)


def step_sequences(dist: str, seq_len: int, n_seq: int, step: int, seed: int = 0,
                   length: int | None = None) -> list[list[int]]:
    """The ``n_seq`` sequences of step ``step``: the stream's sequences ``[n_seq step, n_seq (step + 1))``,
    continued by the next stream (next seed) where one runs out. ``length``: documents of ``uniform``."""
    if dist not in SAMPLERS:
        sample_kwargs(dist)                        # an unknown name fails here, naming the valid ones
    seq_len, n_seq = _positive_int("seq_len", seq_len), _positive_int("n_seq", n_seq)
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    first, out, part = n_seq * int(step), [], 0
    while len(out) < n_seq:
        seqs = _sequences(dist, seq_len, int(seed), part, length)
        if first < len(seqs):
            take = seqs[first:first + n_seq - len(out)]
            out += [list(s) for s in take]
            first = 0
        else:
            first -= len(seqs)
        part += 1
        if part > 10_000:
            raise ValueError(f"{dist!r} gives no full sequence of {seq_len} tokens")
    return out
