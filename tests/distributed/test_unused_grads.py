"""A trainable weight that only some ranks use (``unused_grads_worker.py``: a linear that runs on
rows of 8 positions or more; rank 0's row has 4) gets a zero gradient on the others, so FSDP2's
reduction of the layer's gradients has the same weights on every rank: the step completes and
every gradient equals one process's; a weight no rank uses keeps no gradient, as in one process. Without the hook the ranks' reductions differ in size and
the job stops (the check that the test depends on the hook)."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).resolve().parent / "unused_grads_worker.py"


def test_a_weight_one_rank_leaves_unused_reduces_as_one_process(launcher, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert launcher.run(WORKER, ["--out", str(one)], nproc=1).returncode == 0
    job = launcher.run(WORKER, ["--out", str(two)], nproc=2)
    assert job.returncode == 0, job.output[-4000:]
    a, b = torch.load(one / "grads.pt"), torch.load(two / "grads.pt")
    assert a.keys() == b.keys()
    for name in ("blocks.0.never.weight", "blocks.1.never.bias"):  # no rank used it: none, as one process
        assert a[name] is None and b[name] is None, name
    for name, grad in a.items():
        if grad is None:
            continue
        # FSDP2 averages over the 2 ranks; one process sums the two rows' backward passes.
        # A few fp32 roundings of values of order 10: far inside 1e-5 relative.
        assert torch.allclose(grad / 2, b[name], rtol=1e-5, atol=1e-6), name
    assert b["blocks.0.extra.weight"].abs().sum() > 0  # rank 1's use reached it


def test_without_the_hook_the_ranks_reduce_different_weights(launcher, tmp_path):
    job = launcher.run(WORKER, ["--out", str(tmp_path), "--no-fill"], nproc=2, timeout_s=120)
    assert job.returncode != 0
    assert not (tmp_path / "grads.pt").exists()
