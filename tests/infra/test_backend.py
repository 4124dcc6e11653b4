"""cadlib.infra.backend.missing_gpus: the one line a notebook prints when its live run needs more GPUs."""
import pytest

from cadlib.infra.backend import missing_gpus


@pytest.mark.parametrize("need, nproc, gpus, line", [
    (2, 0, 0, None),                     # no CUDA: CPU processes (gloo) run it, as in CI
    (2, 4, 0, None),
    (2, 0, 2, None), (2, 0, 8, None), (2, 2, 8, None),
    (2, 0, 1, "needs 2 GPUs; this machine has 1: showing the committed results"),
    (2, 2, 1, "needs 2 GPUs; this machine has 1: showing the committed results"),
    (2, 1, 8, "needs 2 GPUs; this machine has 8 (nproc=1): showing the committed results"),
    (1, 0, 1, None),
])
def test_missing_gpus_says_what_is_missing_only_on_cuda(need, nproc, gpus, line):
    assert missing_gpus(need, nproc, gpus) == line


@pytest.mark.parametrize("kwargs, match", [(dict(need=0, nproc=0, gpus=1), "need must be an integer >= 1"),
                                           (dict(need=2, nproc=-1, gpus=1), "nproc must be"),
                                           (dict(need=2, nproc=0, gpus=True), "gpus must be")])
def test_missing_gpus_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        missing_gpus(**kwargs)
