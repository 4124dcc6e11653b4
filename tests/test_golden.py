"""What the library computes does not change when its code is reorganised: the plans, dispatch sizes
and bytes of the committed end-to-end batches and of the scheduler's bytes grid equal the fingerprints
in ``tests/golden/plans.json`` (see ``tests/golden_plans.py``)."""
import json

import pytest

import golden_plans


def _diff(got, want, path=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys differ"
        for k in want:
            yield from _diff(got[k], want[k], f"{path}/{k}")
    elif got != want:
        yield f"{path}: {got!r} != golden {want!r}"


@pytest.mark.parametrize("part", ["e2e", "grid"])        # two tests, so that two workers share them
def test_plans_dispatch_and_bytes_equal_the_golden_fingerprints(part):
    want = json.loads(golden_plans.GOLDEN.read_text())[part]
    prints = golden_plans.e2e_prints() if part == "e2e" else golden_plans.grid_prints()
    got = json.loads(json.dumps(prints, sort_keys=True))
    diffs = list(_diff(got, want, part))
    assert not diffs, f"{len(diffs)} fingerprints differ, first ones:\n" + "\n".join(diffs[:20])
