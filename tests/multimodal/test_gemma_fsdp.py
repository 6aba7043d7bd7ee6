"""LoRA on a tiny Gemma 3 and Gemma 4 under FSDP2 on 2 gloo ranks equals one process on the same
global batch of image rows (``gemma_fsdp_worker.py``): each rank holds 2 of the 4 rows, and every
other step one rank holds text rows only, so it runs the vision tower (whose blocks are FSDP
units of their own) on a dummy image only (``twinkle.model.vision``). The loss is the mean over the global batch's
supervised tokens either way, so the per-step losses (and the first two steps' gradient norms,
before AdamW carries rounding differences over) agree up to summation order: within twice the
probabilistic bound of the chain of fp32 sums (language model, vision tower over an image's
patches, the ranks' reduction; ``tests/assets/tolerances.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port
from tiny_gemma_vl import BUILDERS
from tolerances import llama_sums, probable_gamma

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("gemma_fsdp_worker.py")
TOKENS, PATCHES = 200, 630  # above the longest row's tokens and an image's patches (Gemma 4's budget)


def _run(nproc: int, args: list[str], cache: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
    env.update(TWINKLE_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, str(WORKER), *args]
    if nproc > 1:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
            *args, "--fsdp-size", str(nproc),
        ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=WORKER.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_lora_on_two_fsdp_ranks_equals_one_process(family, tmp_path):
    folder = BUILDERS[family](tmp_path / "model")
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"x{nproc}"
        out.mkdir()
        _run(nproc, ["--family", family, "--model-id", str(folder), "--out", str(out)], tmp_path / "cache")
        results[nproc] = json.loads((out / "result.json").read_text())
    assert results[2]["world_size"] == 2
    one, two = results[1]["steps"], results[2]["steps"]
    sums = llama_sums(32, 64, 2, TOKENS, 700) + llama_sums(32, 64, 1, PATCHES) + [4 * TOKENS, 48, 2]
    rtol = 2 * probable_gamma(sum(sums))
    print(f"\n[{family} 1 vs 2 ranks] {one}\n{two}")
    assert one[-1]["loss"] < one[0]["loss"]  # it trained
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        for key in ("loss", "grad_norm") if step < 2 else ("loss",):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (step, key, a[key], b[key], rtol)
