"""GKD under FSDP2 on 2 gloo ranks equals one process on the same global batch.

``gkd_worker.py`` runs 3 steps on 6 rows of different completion lengths, each rank holding 3 and
scoring them with an in-process teacher. The divergence is a mean over the global batch's
supervised tokens, so a rank-mean average (the two ranks hold different token counts) or a
teacher tensor laid on the wrong rows would move the loss; the per-step loss, gradient norm and
top-1 agreement agree up to summation order: within ``run_loss_rtol`` (``tests/assets/tolerances.py``)."""

import json
from pathlib import Path

import pytest
from tolerances import run_loss_rtol

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # a 2-process run, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("gkd_worker.py")
ROWS, MAX_TOKENS = 6, 64


def test_gkd_on_two_fsdp_ranks_equals_one_process(tiny_model_dir, tmp_path, launcher):
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"x{nproc}"
        out.mkdir()
        args = ["--model-id", str(tiny_model_dir), "--out", str(out)]
        if nproc > 1:
            args += ["--fsdp-size", str(nproc)]
        job = launcher.run(WORKER, args, nproc=nproc)
        assert job.returncode == 0, job.output[-6000:]
        results[nproc] = json.loads((out / "result.json").read_text())
    assert results[2]["world_size"] == 2
    one, two = results[1]["steps"], results[2]["steps"]
    rtol = run_loss_rtol(ROWS, MAX_TOKENS, 2)
    assert one[-1]["loss"] < one[0]["loss"]  # it trained toward the teacher
    assert 0 < one[0]["top1_agreement"] < 1  # a teacher that disagrees somewhere: the metric means something
    for a, b in zip(one, two, strict=True):
        assert a["supervised_tokens"] == b["supervised_tokens"]
        for key in ("loss", "grad_norm", "top1_agreement"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
