"""Expert parallelism when one rank's experts receive no token at all: a tiny Qwen3-MoE whose
routers are zero, so every token's router probabilities tie and every token chooses the same two
experts (``torch.topk`` breaks the tie the same way on every row), both in one rank's block.

The other rank then runs its experts on no rows. Its backward must still run the same collectives
as the busy rank (the exchange that sent the tokens, in reverse) and give its experts' LoRA a
gradient (zero), or FSDP2's reductions differ between the ranks and the step hangs. With LoRA on
the experts, 3 steps on 2 ranks equal one process's (losses, gradient norms, the saved adapter),
within the bounds of ``test_expert_parallel.py``."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerances import adamw_weight_atol, run_loss_rtol

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import EXPERTS, TOP_K, build_qwen3_moe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ep_worker.py")
STEPS, LR = 3, 1e-2  # as ep_worker.py runs them


def _zero_routers(model_dir: Path) -> Path:
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    routers = [name for name in weights if name.endswith(".mlp.gate.weight")]
    assert len(routers) == 2
    for name in routers:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(path), metadata={"format": "pt"})
    return model_dir


def _run(launcher, model_dir: Path, out: Path, nproc: int) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(STEPS), "--target-parameters"]
    if nproc > 1:
        args += ["--ep-size", "2"]
    job = launcher.run(
        WORKER, args, nproc=nproc, timeout_s=180
    )  # a hang ends here, not in the collective's timeout
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return result


def test_a_rank_whose_experts_get_no_token_trains_as_one_process(tiny_model_dir, tmp_path, launcher):
    # the premise: tied probabilities choose the same experts on every row, all in one block
    chosen = torch.topk(torch.zeros(3, EXPERTS).softmax(-1), TOP_K, dim=-1).indices
    assert (chosen == chosen[0]).all() and len({int(e) // (EXPERTS // 2) for e in chosen[0]}) == 1, chosen
    model_dir = _zero_routers(build_qwen3_moe(tiny_model_dir, tmp_path / "moe"))
    one = _run(launcher, model_dir, tmp_path / "one", 1)
    two = _run(launcher, model_dir, tmp_path / "two", 2)
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    atol = adamw_weight_atol(LR, STEPS)
    assert one["adapter"].keys() == two["adapter"].keys()
    for name, weight in one["adapter"].items():
        assert (weight - two["adapter"][name]).abs().max() <= atol, name
