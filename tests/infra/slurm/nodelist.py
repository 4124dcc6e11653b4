"""SLURM's host list syntax, expanded as ``scontrol show hostnames`` does: ``a,b``, ``node[0-3,7]``,
``gpu[01-02]`` (zero padding kept) and ``127.0.0.[1-2]``. Shared by the stand-in ``srun`` and
``scontrol`` beside it (their folder is first on ``sys.path`` when they run)."""
import re


def expand(nodelist: str) -> list[str]:
    """The hosts of ``nodelist`` in order."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", part)
        if m is None:
            hosts.append(part)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{head}{i:0{len(lo)}d}{tail}")
    return hosts
