"""Ulysses sequence parallelism (2 gloo ranks, ``ulysses_size=2``) equals one process for the
losses with per-token inputs: GRPO and GSPO (per completion: a token mean, GSPO's ratio of the
mean log-ratio, a KL term to the base model), PPO (per-token advantages) and DPO (per pair: the
rows' summed log-probabilities against the base model's, plus an SFT term).

``ulysses_loss_worker.py`` runs 2 LoRA steps on a batch whose longest sample is longer than half
the packed row, so a completion's (or a chosen answer's) tokens lie on both ranks: each rank
scores its half of the positions, with its half of the per-token inputs, and a per-completion or
per-pair value is totalled over the two ranks before the loss reads it. Compared with one
process: the per-step losses and gradient norms within ``run_loss_rtol`` (relative) of the tiny
model's chain of fp32 sums and the ranks' reduction (``tests/assets/tolerances.py``); every LoRA
gradient of the first step elementwise within the same relative bound of its tensor's largest
magnitude (an element is a sum of terms of about that scale, summed in another order); each
rank's step logps, and DPO's reward margin (``DPOMetric``, which must count each pair once
though both ranks hold it), within the loss's bound. A
per-completion value from one rank's tokens only, or a loss counted on both ranks, moves the
loss and the gradients by a sizeable fraction, far outside the bound."""

import json
from pathlib import Path

import pytest
import torch
from tolerances import run_loss_rtol, scale_of

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ulysses_loss_worker.py")
COUNTS = {
    "grpo": "completions", "gspo": "completions", "ppo": "supervised_tokens", "dpo": "pairs", "gkd": "supervised_tokens"
}  # fmt: skip


def _run(launcher, model_dir, out: Path, nproc: int, loss: str, extra: list[str]) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--loss", loss, *extra]
    if nproc > 1:
        args += ["--ulysses-size", str(nproc)]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["grads"] = torch.load(out / "grads.pt")
    result["logps"] = [json.loads((out / f"logps-{r}.json").read_text()) for r in range(nproc)]
    return result


@pytest.mark.parametrize(
    ("loss", "layout"),
    [("grpo", "packed"), ("gspo", "packed"), ("ppo", "padded"), ("dpo", "packed"), ("gkd", "packed")],
)
def test_rl_and_preference_losses_under_ulysses_equal_one_process(
    tiny_model_dir, tmp_path, launcher, loss, layout
):
    extra = ["--padded"] if layout == "padded" else []
    one = _run(launcher, tiny_model_dir, tmp_path / "one", 1, loss, extra)
    two = _run(launcher, tiny_model_dir, tmp_path / "two", 2, loss, extra)
    assert two["world_size"] == 2
    lengths = one["lengths"]
    assert max(lengths) > sum(lengths) / 2  # a sample's tokens lie on both ranks
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    print(
        f"\n[ulysses 2, {loss}] losses {[s['loss'] for s in one['steps']]} vs "
        f"{[s['loss'] for s in two['steps']]}, rtol {rtol:.2e}"
    )
    count = COUNTS[loss]
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a[count] == b[count] > 0, (count, a[count], b[count])  # counted once over the group
        assert 0 < b["rank_tokens"] < a["rank_tokens"] or count != "supervised_tokens"
        keys = ("loss", "grad_norm") + (("reward_margin", "chosen_logps") if loss == "dpo" else ())
        for key in keys:
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    assert one["steps"][0]["grad_norm"] > 0
    # the first step's gradients: every LoRA weight, elementwise
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, grad in one["grads"].items():
        assert grad.abs().max() > 0, name
        allowed = rtol * scale_of(grad)
        assert (grad - two["grads"][name]).abs().max() <= allowed, (name, allowed)
    # each rank's step logps: the whole batch, every rank's positions in place
    for logps in two["logps"]:
        for row_a, row_b in zip(one["logps"][0], logps, strict=True):
            for x, y in zip(row_a, row_b, strict=True):
                assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)
