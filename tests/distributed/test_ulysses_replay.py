"""Routing replay under Ulysses sequence parallelism (2 gloo ranks, ``ulysses_size=2``) equals one
process, on a tiny Qwen3-MoE (2 layers of 8 experts, top-2) and a packed row of 4 samples, one
longer than half the row, so its tokens and their routes lie on both ranks.

Each rank replays its own positions' routes (``routed_experts`` sliced as the positions are) and
a recording forward gathers the shares' routes back into whole rows. ``ulysses_replay_worker.py``
checks on every rank that the routes it recorded, replayed, give the plain forward's logps bit for
bit (packed and padded), and that each training forward ran exactly the replayed experts. Here:
both ranks return the same whole rows' routes, which are one process's wherever the router's
choice is not a near tie (a tie may fall either way under another order of the attention's sums);
the losses, gradient norms and evaluation logps of 2 LoRA steps replaying routes the router did
not choose equal one process's within ``run_loss_rtol`` (``tests/assets/tolerances.py``), and that
replay moved the logps far past that bound.

The process-free part (each rank's routes are its own positions', the padding routed by the
router) is in ``test_sequence_parallel_checks.py``."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ulysses_replay_worker.py")
NEAR_TIE = 1e-3  # router logits closer than this at the top-k boundary may choose either way


def _run(launcher, model_dir: Path, out: Path, nproc: int) -> list[dict]:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out)]
    if nproc > 1:
        args += ["--ulysses-size", str(nproc)]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(nproc)]


def _clear_choices(model_dir: Path, token_rows: list[list[int]]) -> list[torch.Tensor]:
    """Per row ``(tokens, layers)``: whether each router's top-2 is clear of the third expert by
    ``NEAR_TIE`` in a plain forward of that row alone."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    routers = [m for m in lm.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[0].detach())) for r in routers]
    clear = []
    with torch.no_grad():
        for ids in token_rows:
            seen.clear()
            lm(input_ids=torch.tensor([ids]))
            top = torch.stack(seen, dim=1).topk(3, dim=-1).values  # (tokens, layers, 3)
            clear.append(top[..., 1] - top[..., 2] > NEAR_TIE)
    for h in handles:
        h.remove()
    return clear


def test_replay_under_ulysses_equals_one_process(tiny_model_dir, tmp_path, launcher):
    from tolerances import run_loss_rtol

    sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
    from sp_worker import QUESTIONS, rows
    from tiny_moe import build_qwen3_moe

    model_dir = build_qwen3_moe(tiny_model_dir, tmp_path / "qwen3_moe")
    (one,) = _run(launcher, model_dir, tmp_path / "one", 1)
    two = _run(launcher, model_dir, tmp_path / "two", 2)
    assert two[0]["world_size"] == 2
    lengths = one["lengths"]
    assert max(lengths) > sum(lengths) / 2  # a sample's tokens (and routes) lie on both ranks

    # every rank returns the whole rows' routes; one process's wherever the choice is clear
    assert two[0]["recorded"] == two[1]["recorded"] and two[0]["padded"] == two[1]["padded"]
    ids = [r["input_ids"] for r in rows(transformers.AutoTokenizer.from_pretrained(model_dir), QUESTIONS)]
    clear = _clear_choices(model_dir, ids)
    compared = 0
    for layout in ("recorded", "padded"):
        a, b = torch.tensor(one[layout]), torch.tensor(two[0][layout])
        assert a.shape == b.shape and torch.equal(a < 0, b < 0)  # the same tokens ran
        for i, row_clear in enumerate(clear):
            ran = a[i, : lengths[i], :, 0] >= 0
            keep = ran & row_clear
            assert torch.equal(a[i, : lengths[i]][keep], b[i, : lengths[i]][keep]), (layout, i)
            compared += int(keep.sum())
            assert bool((a[i, lengths[i] :] < 0).all())  # pads ran no router
    assert compared > 0.9 * 2 * sum(lengths) * 2  # nearly every token and layer, in both layouts

    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    assert min(one["moved"], two[0]["moved"]) > 10 * rtol  # replay changed what the model computes
    print(
        f"\n[ulysses 2, replay] losses {[s['loss'] for s in one['steps']]} vs "
        f"{[s['loss'] for s in two[0]['steps']]}, rtol {rtol:.2e}"
    )
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two[0]["steps"], strict=True):
        for key in ("samples", "supervised_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    for rank in two:  # each rank's evaluation logps cover the whole batch
        for row_a, row_b in zip(one["logps"], rank["logps"], strict=True):
            for x, y in zip(row_a, row_b, strict=True):
                assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)
