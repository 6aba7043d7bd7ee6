"""The vision blocks of a tiny Qwen2.5-VL, Gemma 3 and Gemma 4 are FSDP2 units of their own, and
every rank runs the tower whenever any rank has images (``twinkle.model.vision.TowerOnEveryRank``).

On 2 gloo ranks (``vl_units_worker.py``: 4 LoRA steps, one with images on both ranks, two with
the second rank's rows text only, one with no image anywhere), with LoRA on the language model
only and on the tower too: every vision block is an ``FSDPModule``; the text-only rank runs the
tower (on the dummy image) exactly when the other has images; a sampler sharing the model samples
an image prompt on one rank and a text prompt on the other; the per-step losses and the first
two steps' gradient norms equal one process's up to summation order (twice the probabilistic
bound of the chain of fp32 sums, ``tests/assets/tolerances.py``), and the saved adapters are
within ``adamw_weight_atol``. With LoRA on the tower, a rank that skipped it would hold no
gradient for the tower's weights while the other did, and the job would stop in the reduction.

In one process (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3, Gemma 4), the dummy's features join the
language model's input as exactly zero: logits and the language model's gradients are bit-equal
with and without it, and the tower's LoRA weights get gradients that are all zero."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file
from tiny_gemma_vl import BUILDERS
from tolerances import adamw_weight_atol, llama_sums, probable_gamma

WORKER = Path(__file__).with_name("vl_units_worker.py")
# family -> above the longest row's tokens, above a batch's (Gemma: an image's) patches, and the
# further sums of its chain (Gemma 4's pooling of a soft token's patches), as in test_vl_fsdp.py
# and test_gemma_fsdp.py
SIZES = {"qwen2_5_vl": (80, 400, []), "gemma3": (200, 630, [48]), "gemma4": (200, 630, [48])}
TOWER = r"\.(visual|vision_tower|multi_modal_projector|embed_vision)\."  # tower and projector weights
STEPS, LR = 4, 1e-2  # as vl_units_worker.py runs


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


@pytest.mark.slow
@pytest.mark.cluster  # 2-process runs, with the other `-m cluster` suites
@pytest.mark.parametrize("tower_lora", [False, True], ids=["lm-lora", "tower-lora"])
@pytest.mark.parametrize("family", list(SIZES))
def test_vision_blocks_as_units_on_two_ranks_equal_one_process(family, tower_lora, tiny_vl_dir, tmp_path):
    folder = tiny_vl_dir if family == "qwen2_5_vl" else BUILDERS[family](tmp_path / "model")
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"x{nproc}"
        out.mkdir()
        flags = ["--family", family, *(["--tower-lora"] if tower_lora else [])]
        _run(nproc, ["--model-id", str(folder), "--out", str(out), *flags], tmp_path / "cache")
        ranks = [json.loads((out / f"result-{r}.json").read_text()) for r in range(nproc)]
        results[nproc] = {"ranks": ranks, "adapter": load_file(out / "adapter" / "adapter_model.safetensors")}
    one, two = results[1]["ranks"][0], results[2]["ranks"]
    assert two[0]["world_size"] == 2
    assert (one["tower_lora"] > 0) == tower_lora
    assert one["blocks_are_units"] and not any(one["blocks_are_units"])  # one process shards nothing
    for rank in two:
        assert rank["blocks_are_units"] and all(rank["blocks_are_units"]), rank["blocks_are_units"]
        # the tower ran in steps 1, 2 and 4 on both ranks (on the dummy image for rank 1's text
        # rows in steps 2 and 4), and on neither in step 3, where no rank had an image
        assert [s["tower_runs"] for s in rank["steps"]] == [1, 2, 2, 3]
    tokens, patches, extra = SIZES[family]
    sums = llama_sums(32, 64, 2, tokens, 700) + llama_sums(32, 64, 1, patches) + [4 * tokens, *extra, 2]
    rtol = 2 * probable_gamma(sum(sums))
    a_steps, b_steps = one["steps"], two[0]["steps"]
    print(f"\n[{family} units, tower LoRA {tower_lora}] {a_steps}\n{b_steps}")
    assert a_steps[-1]["loss"] < a_steps[0]["loss"]  # it trained
    for step, (a, b) in enumerate(zip(a_steps, b_steps, strict=True)):
        # a gradient norm after two AdamW steps also carries the optimizer's amplification of the
        # weights' rounding differences (a gradient near zero may flip a weight's update)
        for key in ("loss", "grad_norm") if step < 2 else ("loss",):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (step, key, a[key], b[key], rtol)
    # a sampler sharing the sharded model, an image in rank 0's prompt and none in rank 1's, runs
    # in lockstep to the end and draws one process's greedy tokens, up to a step whose runner-up
    # lies within the rounding of the chosen token's log-probability
    sampled_two = [seq for rank in two for seq in rank["sampled"]]
    assert len(sampled_two) == len(one["sampled"]) == 2
    for steps_one, steps_two in zip(one["sampled"], sampled_two, strict=True):
        assert steps_two
        for a, b in zip(steps_one, steps_two, strict=False):
            if len(a) > 1 and a[0][1] - a[1][1] <= 4 * rtol * max(1.0, abs(a[0][1])):
                break  # a near tie: either token may win
            assert a[0][0] == b[0][0], (a, b)
    adapter_one, adapter_two = results[1]["adapter"], results[2]["adapter"]
    assert adapter_one.keys() == adapter_two.keys()
    assert any(re.search(TOWER, name) for name in adapter_one) == tower_lora
    atol = adamw_weight_atol(LR, STEPS)
    for name, weight in adapter_one.items():
        assert (weight - adapter_two[name]).abs().max() <= atol, name


FAMILIES = {  # model class, and the checkpoint's builder (None: the tiny_vl_dir fixture)
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", None),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "build_tiny_qwen3_vl"),  # deepstack features
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "build_tiny_qwen3_5_vl"),
    "gemma3": ("Gemma3ForConditionalGeneration", "gemma3"),  # tiny_gemma_vl.BUILDERS
    "gemma4": ("Gemma4ForConditionalGeneration", "gemma4"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dummy_image_adds_exactly_zero(family, tiny_vl_dir, tmp_path):
    import importlib

    import transformers
    from peft import LoraConfig, get_peft_model

    from twinkle.model.vision import TowerOnEveryRank

    cls, builder = FAMILIES[family]
    folder = tiny_vl_dir
    if builder in BUILDERS:
        folder = BUILDERS[builder](tmp_path / "model")
    elif builder is not None:
        folder = getattr(importlib.import_module(builder.replace("build_", "")), builder)(tmp_path / "model")
    torch.manual_seed(0)
    base = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, config)  # PEFT's all-linear: the tower and projector too
    tower = TowerOnEveryRank(base)  # only its language-model hook: one process has no collective
    base.model.language_model.register_forward_pre_hook(tower.add_dummy, with_kwargs=True)
    runs = []
    visual = base.model.visual if hasattr(base.model, "visual") else base.model.vision_tower
    visual.register_forward_hook(lambda *_: runs.append(1))
    input_ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(dummy: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        model.zero_grad(set_to_none=True)
        tower.armed = dummy
        logits = model(input_ids=input_ids, use_cache=False).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads

    plain_logits, plain = run(False)
    assert runs == []
    dummy_logits, dummy = run(True)
    assert runs == [1]  # the tower ran once, on the dummy image
    assert torch.equal(plain_logits, dummy_logits)
    # Gemma 3 reads its SigLIP tower's last hidden state, never the tower's pooling head
    tower_names = [n for n in dummy if re.search(TOWER, n) and ".vision_tower.head." not in n]
    assert tower_names and all(plain[n] is None for n in tower_names)
    for name in tower_names:  # the tower's backward ran and added nothing
        assert dummy[name] is not None and not dummy[name].any(), name
    for name, grad in plain.items():
        if name not in tower_names:
            same = grad is None and dummy[name] is None  # the pooling head: none either way
            assert same or torch.equal(grad, dummy[name]), name
