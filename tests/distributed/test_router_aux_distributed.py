"""The router's load-balancing loss on 2 gloo ranks (``twinkle.model.router_aux``).

Under Ulysses (``ulysses_size=2``) it equals one process's: each rank routes its half of the
positions, and the group totals the aux's per-expert sums (top-k counts, router probabilities,
tokens), so both ranks compute the aux of the whole rows. On 2 data ranks (FSDP2), each with its
own micro-batch, it is the mean of the two micro-batches' aux, as one process running both in one
accumulation window makes it when they hold as many targets.

``router_aux_worker.py`` runs one full-parameter step of a tiny Qwen3-MoE (2 layers of 8
experts, top-2) whose config asks for the aux (``router_aux_loss_coef`` 0.5), on 4 chat samples,
one longer than half the packed row. Compared with one process: the step's ``aux_loss`` (on rank
0, whose step loss is the mean over its share of the positions), the metrics (``loss``,
``aux_loss``) and the gradient norm within ``run_loss_rtol`` of the tiny model's chain of fp32
sums and the ranks' reduction; every weight's gradient elementwise within the same relative bound
of its tensor's largest magnitude. A rank's aux over its own half of the positions is another
load-balancing product (another aux value, another router
gradient), far outside the bound."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tolerances import run_loss_rtol, scale_of

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import build_qwen3_moe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("router_aux_worker.py")


def _with_aux_loss(model_dir: Path) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=0.5)
    path.write_text(json.dumps(config))
    return model_dir


def _run(launcher, model_dir: Path, out: Path, nproc: int, extra: list[str]) -> dict:
    """The worker as ``nproc`` processes; ``extra``: its options (``--ulysses-size``, ...)."""
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), *extra]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    result = json.loads((out / "result.json").read_text())
    result["grads"] = torch.load(out / "grads.pt")
    return result


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_router_aux_under_ulysses_equals_one_process(tiny_model_dir, tmp_path, launcher, layout):
    model_dir = _with_aux_loss(build_qwen3_moe(tiny_model_dir, tmp_path / "qwen3_moe"))
    extra = ["--padded"] if layout == "padded" else []
    one = _run(launcher, model_dir, tmp_path / "one", 1, extra)
    two = _run(launcher, model_dir, tmp_path / "two", 2, [*extra, "--ulysses-size", "2"])
    assert two["world_size"] == 2
    lengths = one["lengths"]
    assert max(lengths) > sum(lengths) / 2  # a sample's tokens lie on both ranks
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    print(f"\n[ulysses 2, router aux, {layout}] aux {one['aux_loss']} vs {two['aux_loss']}, rtol {rtol:.2e}")
    assert one["aux_loss"] > 0
    pairs = [(one["aux_loss"], two["aux_loss"])]  # a rank's step loss is its share's; its aux the rows'
    pairs += [(one["metrics"][k], two["metrics"][k]) for k in ("loss", "aux_loss", "grad_norm")]
    for a, b in pairs:
        assert abs(a - b) <= rtol * max(1.0, abs(a)), (a, b, rtol)
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, grad in one["grads"].items():
        allowed = rtol * scale_of(grad)
        assert (grad - two["grads"][name]).abs().max() <= allowed, (name, allowed)


def test_router_aux_on_two_data_ranks_is_the_mean_of_their_aux(tiny_model_dir, tmp_path, launcher):
    """2 FSDP2 ranks, each its own micro-batch, equal one process running both in one window: with
    as many targets in either, both make the aux's gradient ``coef`` times the mean of the two
    micro-batches' aux (``RouterAux.step_term``)."""
    model_dir = _with_aux_loss(build_qwen3_moe(tiny_model_dir, tmp_path / "qwen3_moe"))
    one = _run(launcher, model_dir, tmp_path / "one", 1, ["--halves"])
    two = _run(launcher, model_dir, tmp_path / "two", 2, ["--halves"])
    assert two["world_size"] == 2
    rtol = run_loss_rtol(2, 17, 2)
    print(f"\n[2 data ranks, router aux] {one['metrics']} vs {two['metrics']}, rtol {rtol:.2e}")
    assert one["metrics"]["aux_loss"] > 0
    for key in ("loss", "aux_loss", "grad_norm"):
        a, b = one["metrics"][key], two["metrics"][key]
        assert abs(a - b) <= rtol * max(1.0, abs(a)), (key, a, b, rtol)
    for name, grad in one["grads"].items():
        allowed = rtol * scale_of(grad)
        assert (grad - two["grads"][name]).abs().max() <= allowed, (name, allowed)
