"""FSDP2 on CPU (gloo): N processes train exactly like one process on the same global batch.

Each test launches ``train_worker.py`` (the contract's pipeline on the tiny Llama: 6 micro-batches
of 4 samples, 2 per optimizer step) and compares the per-step losses (reduced over ranks), the
gradient norms and the final full LoRA weights. Every run shares one configuration, so the
1-process reference and the 2-rank FSDP run (which also saves mid-window) serve several tests:
process start-up (imports) is most of the cost, the steps themselves are cheap.

Tolerances, derived (tests/assets/tolerances.py), not measured:
* Losses: the N-process run computes the same numbers summed in another order (per-rank sums,
  then the FSDP reduce-scatter / HSDP all-reduce): within ``run_loss_rtol`` of each other,
  relative (the tiny model's chain of sums over the global batch of 4 rows, at most 128 tokens,
  and the ranks' reduction, at Higham and Mary's probabilistic bound: ~5e-5, 3.4e-4 of a loss of
  6.4). A rank's rows dropped or counted twice move the mean token loss by percents.
* Gradient norms (fp32, before the optimizer), relative: each gradient element within that bound
  of its tensor's largest, so the norm within it times 1 + sqrt(largest tensor's size). The
  optimizers are scale-invariant, so the norms catch a gradient mis-scaled by a constant (a
  factor of 2 for a doubled rank), which the weights would not show.
* Weights, elementwise: AdamW moves a weight by about lr a step, and one whose gradient is within
  its rounding error of zero may step the other way (``adamw_weight_atol``: 2 lr a step); Muon's
  bf16 Newton-Schulz may flip roundings (``muon_weight_atol``). The losses are the finer check.
"""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, muon_weight_atol, run_loss_rtol

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("train_worker.py")
STEPS = 6  # micro-batches of 4 samples (the global batch) per run
GRAD_ACCUM = 2  # gradients also accumulate across micro-batches while sharded
SAVE_AT = 3  # inside the second accumulation window: the checkpoint holds an open window
LR = 1e-2  # train_worker.py's, both optimizers
GLOBAL_ROWS, MAX_TOKENS = 4, 128  # train_worker.py's global batch and max_length


@pytest.fixture(scope="module")
def train(tiny_model_dir, tmp_path_factory, launcher):
    """``train(nproc, **flags)`` runs the worker once per distinct configuration (the 1-process
    reference is shared by several tests) and returns its result.json plus its output folder."""
    done = {}

    def run(nproc: int = 1, **flags) -> dict:
        flags = {"steps": STEPS, "grad_accum": GRAD_ACCUM, "optimizer": "AdamW", **flags}
        key = (nproc, tuple(sorted(flags.items())))
        if key not in done:
            out = tmp_path_factory.mktemp(f"run{nproc}")
            args = ["--model-id", str(tiny_model_dir), "--out", str(out)]
            for name, value in flags.items():
                args += [f"--{name.replace('_', '-')}", str(value)]
            job = launcher.run(WORKER, args, nproc=nproc)
            assert job.returncode == 0, job.output[-6000:]
            result = json.loads((out / "result.json").read_text())
            result.update(out=out, wall_s=job.wall_s)
            print(f"\n[{nproc} proc {flags}] {job.wall_s:.1f} s")
            done[key] = result
        return done[key]

    return run


def tolerances(result: dict, nproc: int, optimizer: str = "AdamW") -> dict:
    """The derived bounds of the module docstring for a comparison with an ``nproc``-rank run."""
    loss = run_loss_rtol(GLOBAL_ROWS, MAX_TOKENS, nproc)
    shapes = [torch.tensor(v).shape for v in result["weights"].values()]
    steps = -(-STEPS // GRAD_ACCUM)  # optimizer steps in a whole run
    if optimizer == "Muon":
        weight = muon_weight_atol(LR, steps, shapes)
    else:
        weight = adamw_weight_atol(LR, steps)
    largest = max(math.prod(shape) for shape in shapes)
    return {"loss": loss, "grad_norm": loss * (1 + math.sqrt(largest)), "weight": weight}


def compare(a: dict, b: dict, tol: dict, label: str, skip_steps: int = 0) -> None:
    """Same steps; losses within ``tol['loss']`` relative, gradient norms within
    ``tol['grad_norm']`` relative, final LoRA weights within ``tol['weight']``."""
    steps_a = a["steps"][skip_steps:]
    assert [s["step"] for s in steps_a] == [s["step"] for s in b["steps"]]
    loss_diff = max(abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(steps_a, b["steps"], strict=True))
    # grad_norm is NaN on micro-steps that did not step the optimizer; those must agree too.
    norms = [(x["grad_norm"], y["grad_norm"]) for x, y in zip(steps_a, b["steps"], strict=True)]
    assert [math.isnan(x) for x, _ in norms] == [math.isnan(y) for _, y in norms], norms
    norm_diff = max((abs(x - y) / x for x, y in norms if not math.isnan(x)), default=0.0)
    assert a["weights"].keys() == b["weights"].keys()
    weight_diff = max(
        (torch.tensor(a["weights"][k]) - torch.tensor(b["weights"][k])).abs().max().item()
        for k in a["weights"]
    )
    print(
        f"\n[{label}] max |loss diff| {loss_diff:.2e}, |weight diff| {weight_diff:.2e}, grad-norm rel {norm_diff:.2e}"
    )
    print(f"[{label}] allowed {tol}")
    assert loss_diff <= tol["loss"], f"{label}: losses differ by {loss_diff:.3e} (relative)"
    assert norm_diff <= tol["grad_norm"], f"{label}: gradient norms differ by {norm_diff:.3e} (relative)"
    assert weight_diff <= tol["weight"], f"{label}: LoRA weights differ by {weight_diff:.3e}"


def assert_trained(result: dict) -> None:
    """The comparison means something only if the run moved: every LoRA B left its zero init.
    (Losses of different batches are not comparable, so they cannot show it.)"""
    lora_b = [torch.tensor(v).abs().max().item() for k, v in result["weights"].items() if "lora_B" in k]
    assert min(lora_b) > 1e-3


def test_shutdown_stops_every_gloo_thread(train):
    """After ``shutdown`` no gloo worker or socket thread is left to run into the interpreter's
    teardown (where a peer closing its sockets once aborted rank 0 of a finished run)."""
    runs = {
        "fsdp=2": (2, train(2, optimizer="AdamW", fsdp_size=2, dp_size=1, save_at=SAVE_AT)["out"]),
        "fsdp=2 x dp=2": (4, train(4, fsdp_size=2, dp_size=2)["out"]),
    }
    for label, (nproc, out) in runs.items():
        for rank in range(nproc):
            names = json.loads((out / f"threads_rank{rank}.json").read_text())
            assert names, "no thread listed: /proc/self/task was not read"
            left = [n for n in names if "gloo" in n]
            assert not left, f"{label}, rank {rank}: threads left after shutdown: {names}"


# The Muon run recomputes its layers (activation checkpointing on): one launch checks both, as
# recomputation changes no number of one process's run (its own test below).
SHARDED = {"AdamW": {}, "Muon": {"activation_checkpointing": "on"}}


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_fsdp2_matches_one_process(train, optimizer):
    single = train(1, optimizer=optimizer)
    assert_trained(single)
    sharded = train(2, optimizer=optimizer, fsdp_size=2, dp_size=1, save_at=SAVE_AT, **SHARDED[optimizer])
    compare(single, sharded, tolerances(single, 2, optimizer), f"fsdp=2 {optimizer}")


def test_fused_ce_under_fsdp2_matches_one_process(train):
    # The chunked fused loss reads the tied head weight after the root forward: under FSDP2 it
    # must gather the sharded embedding (full_tensor) and give the gradients of one process.
    single = train(1, task="fused_lm_ce")
    assert_trained(single)
    sharded = train(2, fsdp_size=2, dp_size=1, task="fused_lm_ce")
    compare(single, sharded, tolerances(single, 2), "fsdp=2 fused CE")


def test_activation_checkpointing_under_fsdp2_matches_one_process(train):
    # Recomputed layers inside FSDP2's unshard/reshard hooks give one process's results: the
    # losses and gradient norms within the same bounds as without; the run is the Muon one above.
    single = train(1, optimizer="Muon")
    sharded = train(2, optimizer="Muon", fsdp_size=2, dp_size=1, save_at=SAVE_AT, **SHARDED["Muon"])
    compare(single, sharded, tolerances(single, 2, "Muon"), "fsdp=2 activation checkpointing")


def test_bf16_weights_under_fsdp2_match_one_process(train):
    # --dtype bfloat16 on the CPU: bf16 base weights with fp32 LoRA weights in one FSDP2 unit;
    # the ranks run other rows, so bf16 rounding differs and the tolerance is bf16's.
    single = train(1, dtype="bfloat16")
    assert_trained(single)
    fp32 = [s["loss"] for s in train(1)["steps"]]
    assert [s["loss"] for s in single["steps"]] != fp32  # the weights really were bf16
    sharded = train(2, fsdp_size=2, dp_size=1, dtype="bfloat16")
    # The weights as for fp32 (adamw_weight_atol: 2 lr a step, 6e-2). The losses and norms: no
    # useful bound follows from bf16's roundings (a worst case of ~60 of 2^-8 each along the
    # chain says nothing), so these stay measured, at ~10x what was seen: losses 3e-4 relative
    # (2e-3 of 6.4), norms 1e-2, and the whole vector of weights 1e-2 relative.
    tol = {"loss": 3e-4, "weight": adamw_weight_atol(LR, 3), "grad_norm": 1e-2}
    compare(single, sharded, tol, "fsdp=2 bf16")
    a, b = (
        torch.cat([torch.tensor(r["weights"][k]).flatten() for k in sorted(r["weights"])])
        for r in (single, sharded)
    )
    assert (a - b).norm() / a.norm() < 1e-2


def test_dp2_matches_one_process(train):
    single = train(1)
    compare(single, train(2, fsdp_size=1, dp_size=2), tolerances(single, 2), "dp=2 AdamW")


def test_hsdp_2x2_matches_one_process(train):
    # The global batch of 4 gives each of the 4 ranks one sample. Same steps as the other runs,
    # so the 1-process reference is shared: a shorter run would need its own reference, and
    # start-up, not steps, is what costs.
    single = train(1)
    compare(single, train(4, fsdp_size=2, dp_size=2), tolerances(single, 4), "fsdp=2 x dp=2 AdamW")


def test_resume_on_two_ranks_continues_exactly(train):
    full = train(2, fsdp_size=2, dp_size=1, save_at=SAVE_AT)  # the uninterrupted run
    checkpoint = full["out"] / f"step-{SAVE_AT}"
    assert sorted(p.name for p in checkpoint.glob("rank_state_rank*.pt")) == [
        "rank_state_rank0.pt",
        "rank_state_rank1.pt",
    ]
    resumed = train(2, fsdp_size=2, dp_size=1, resume=checkpoint)
    assert [s["step"] for s in resumed["steps"]] == list(range(SAVE_AT + 1, STEPS + 1))
    compare(full, resumed, tolerances(full, 2), "resume 2 ranks", skip_steps=SAVE_AT)


def test_two_rank_checkpoint_in_one_process(train, tiny_model_dir):
    from twinkle.utils.errors import UserError

    full = train(2, fsdp_size=2, dp_size=1, save_at=SAVE_AT)
    checkpoint = full["out"] / f"step-{SAVE_AT}"
    worker = _import_worker()
    args = worker.argparse.Namespace(
        model_id=str(tiny_model_dir),
        optimizer="AdamW",
        grad_accum=GRAD_ACCUM,
        activation_checkpointing="auto",
        dtype="float32",
    )

    model = worker.build_model(args, STEPS)
    with pytest.raises(UserError, match=r"saved by 2 process\(es\).*1.*same world size.*--resume-only-model"):
        model.resume_from_checkpoint(str(checkpoint))

    model = worker.build_model(args, STEPS)
    progress = model.resume_from_checkpoint(str(checkpoint), resume_only_model=True)
    assert (
        progress["cur_step"] == SAVE_AT
    )  # the weights and the place in the run come back, not the optimizer
    saved = load_file(checkpoint / "adapter_model.safetensors")
    current = {n: p.detach() for n, p in model.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(current) > 0
    for key, value in saved.items():
        name = next(n for n in current if n.replace(".default", "") == key)
        torch.testing.assert_close(current[name], value, rtol=0, atol=0)


def _import_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"train_worker" in cmdline


def test_failing_rank_ends_the_job(tiny_model_dir, tmp_path, launcher):
    args = ["--model-id", str(tiny_model_dir), "--out", str(tmp_path), "--steps", str(STEPS)]
    args += ["--fsdp-size", "2", "--dp-size", "1", "--fail-rank", "1", "--fail-at-step", "2"]
    job = launcher.run(WORKER, args, nproc=2, timeout_s=90)
    print(f"\n[failing rank] exit {job.returncode} after {job.wall_s:.1f} s")
    assert job.returncode != 0
    assert job.wall_s < 90
    assert "injected failure on rank 1 at step 2" in job.output
    pids = [int((tmp_path / f"pid_rank{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"workers {pids} outlived the job"


def test_a_save_failing_on_one_rank_fails_every_rank_at_once(tiny_model_dir, tmp_path, launcher):
    # Rank 1's disk is full: both ranks must stop with the error right away, not rank 0 waiting
    # in a collective for the process-group timeout (30 s in the worker).
    args = ["--model-id", str(tiny_model_dir), "--out", str(tmp_path), "--steps", "2", "--save-at", "1"]
    args += ["--fsdp-size", "2", "--dp-size", "1", "--fail-save-rank", "1"]
    job = launcher.run(WORKER, args, nproc=2, timeout_s=90)
    print(f"\n[failing save] exit {job.returncode} after {job.wall_s:.1f} s")
    assert job.returncode != 0
    assert "No space left on device" in job.output and "another rank failed" in job.output
    assert "Timeout" not in job.output and "timed out" not in job.output
    assert not list(tmp_path.glob(".step-1*")) and not (tmp_path / "step-1").exists()
