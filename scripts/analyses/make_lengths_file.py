#!/usr/bin/env python
"""Write a lengths file drawn from one of cadlib's named document-length distributions (the files of
data/lengths/ come from here):

    python scripts/analyses/make_lengths_file.py prolong512k 30000 data/lengths/prolong512k_sample.txt \
        --seed 0

The ``n`` lengths are the first ``n`` documents :func:`cadlib.data.workload.sample_docs` draws for the
seed (a budget large enough that none of them is the clipped last one): ``round(Q(u))`` of the table's
quantile function at the seed's uniforms. One integer per line after a ``#`` header naming the source.
"""
from __future__ import annotations

import argparse
import sys

from cadlib.data.lengths import write_lengths
from cadlib.data.workload import QUANTILE_TABLES, sample_docs


def draw(dist: str, n: int, seed: int) -> list[int]:
    """The first ``n`` documents of ``sample_docs(dist, budget, seed)``, none of them clipped."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    budget = 4096 * n
    while True:
        docs = sample_docs(dist, budget, seed)
        if len(docs) > n:
            return docs[:n]
        budget *= 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dist", choices=sorted(QUANTILE_TABLES))
    ap.add_argument("n", type=int)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    lens = draw(a.dist, a.n, a.seed)
    header = (f"{a.n} document lengths in tokens drawn from cadlib's '{a.dist}' distribution "
              f"(cadlib/data/workload.py, QUANTILE_TABLES), seed {a.seed}:\n"
              f"python scripts/analyses/make_lengths_file.py {a.dist} {a.n} {a.out} --seed {a.seed}")
    write_lengths(a.out, lens, header)
    print(f"wrote {a.out}: {len(lens)} lengths, {sum(lens):,} tokens, longest {max(lens):,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
