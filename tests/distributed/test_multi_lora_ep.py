"""Multi-LoRA with LoRA on the experts under expert parallelism, on 2 gloo ranks (ep_size 2 over 2
FSDP2 shards), on the tiny DeepSeek-V4 of ``test_ep_deepseek_v4.py``.

``multi_lora_ep_worker.py`` trains adapters ``a`` (all-linear but ``o_a_proj``, both expert
parameters, r 4) and ``b`` (``q_b_proj`` and ``gate_up_proj`` only, r 2) interleaved on one
``MultiLoraTransformersModel`` in upstream's cookbook shape, then each alone on a plain
``TransformersModel`` under the same mesh from the same initial weights, and the multi-LoRA run
in one process. Each rank adds only its block of experts' update for every slot, as the single
adapter does: the per-step losses and gradient norms of the three agree within
``run_loss_rtol`` (sums in other orders, over 2 ranks), the saved adapters within
``adamw_weight_atol``, and every saved adapter holds the whole expert LoRA (all 8 experts)."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_ep_deepseek_v4 import build_deepseek_v4
from tolerances import adamw_weight_atol, run_loss_rtol

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("multi_lora_ep_worker.py")
STEPS, LR, EXPERTS = 3, 1e-2, 8  # as the worker trains; the checkpoint's routed experts


def run(launcher, out: Path, nproc: int, *args: str) -> dict:
    out.mkdir()
    extra = ["--ep-size", "2"] if nproc > 1 else []
    job = launcher.run(WORKER, ["--out", str(out), *extra, *args], nproc=nproc, timeout_s=300)
    assert job.returncode == 0, job.output[-6000:]
    return json.loads((out / "result.json").read_text())


def adapter(folder: Path) -> dict:
    return load_file(str(folder / "adapter_model.safetensors"))


def test_adapters_on_expert_slots_under_ep_equal_each_alone(tiny_model_dir, tmp_path, launcher):
    model = ["--model-id", str(build_deepseek_v4(tiny_model_dir, tmp_path / "v4"))]
    multi = run(launcher, tmp_path / "multi", 2, *model, "--mode", "multi")
    one = run(launcher, tmp_path / "one", 1, *model, "--mode", "multi")
    assert multi["world_size"] == 2 and one["world_size"] == 1
    rtol = run_loss_rtol(len(multi["lengths"]), max(multi["lengths"]), 2)
    atol = adamw_weight_atol(LR, STEPS)
    for name, r, expert_parameters in (("a", 4, 2), ("b", 2, 1)):
        start = tmp_path / "multi" / f"init-{name}"
        solo = run(
            launcher,
            tmp_path / f"solo-{name}",
            2,
            *model,
            "--mode",
            "solo",
            "--adapter",
            name,
            "--init-folder",
            str(start),
        )
        steps = multi["steps"][name]
        print(
            f"\n[multi-LoRA ep 2, {name}] {[s['loss'] for s in steps]} alone {[s['loss'] for s in solo['steps'][name]]}"
        )
        assert steps[-1]["loss"] < steps[0]["loss"]  # it trained
        for other in (solo["steps"][name], one["steps"][name]):
            for a, b in zip(steps, other, strict=True):
                for key in ("loss", "grad_norm"):
                    assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(b[key])), (
                        name,
                        key,
                        a[key],
                        b[key],
                        rtol,
                    )
        saved = adapter(tmp_path / "multi" / f"final-{name}")
        for other in (tmp_path / f"solo-{name}" / f"final-{name}", tmp_path / "one" / f"final-{name}"):
            expected = adapter(other)
            assert saved.keys() == expected.keys(), sorted(set(saved) ^ set(expected))
            for key, weight in expected.items():
                assert (saved[key] - weight).abs().max() <= atol, (name, key)
        # the whole expert LoRA of each of the 2 routed MoE layers and the hash-routed one: r rows per expert
        expert_a = [k for k in saved if ".experts." in k and "lora_A" in k]
        assert len(expert_a) == 3 * expert_parameters
        assert all(saved[k].shape[0] == r * EXPERTS for k in expert_a)
        initial = adapter(start)
        assert any((saved[k] - initial[k]).abs().max() > LR for k in saved if ".experts." in k)
