"""DPO under FSDP2 on 2 gloo ranks equals one process on the same global batch of pairs.

``dpo_worker.py`` runs 3 steps (reference pass with the adapters off, DPO step with
``sft_weight``) on 4 pairs; each rank holds 2 whole pairs. The loss is the mean over the pairs of
the global batch either way, so the per-step losses, reward margins and gradient norms agree up
to summation order: within ``run_loss_rtol`` of the tiny model's chain over the 8 rows and the
ranks' reduction (``tests/assets/tolerances.py``), relative; the loss also within the issue's
1e-5 (the probabilistic bound's typical error, sqrt(n) u, is far below it). A pair loss counted
per rank instead of over the global batch (a mean of rank means weighted wrongly, or a doubled
rank) moves the loss by far more once the steps have moved the pairs apart."""

import json
from pathlib import Path

import pytest
from tolerances import run_loss_rtol

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
]  # a 2-process run: with the other multi-process suites in `-m cluster` (CI runs both)

WORKER = Path(__file__).with_name("dpo_worker.py")
ROWS, MAX_TOKENS = 8, 64


def test_dpo_on_two_fsdp_ranks_equals_one_process(tiny_model_dir, tmp_path, launcher):
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
    assert one[-1]["loss"] < one[0]["loss"]  # it trained
    print(
        f"\n[dpo 1 vs 2 ranks] losses {[s['loss'] for s in one]} vs {[s['loss'] for s in two]}, rtol {rtol:.2e}"
    )
    for a, b in zip(one, two, strict=True):
        assert a["pairs"] == b["pairs"] == 4 and "supervised_tokens" not in a
        for key in ("loss", "reward_margin", "chosen_logps", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
        assert abs(a["loss"] - b["loss"]) <= 1e-5
