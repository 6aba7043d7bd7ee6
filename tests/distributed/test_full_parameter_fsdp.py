"""Full-parameter training under FSDP2 on 2 gloo ranks equals one process on the same global batch.

The file is also its own worker (``python test_full_parameter_fsdp.py``, or under torchrun with
``--fsdp-size N``): a model without an adapter trains every weight for 3 steps on 8 fixed rows
(each rank a contiguous share), saves after step 2, and a second model resumed from that
checkpoint runs step 3 again; rank 0 writes ``OUT/result.json`` (per-step metrics, the resumed
step's, whether the weights and the optimizer's state were sharded) and the final checkpoint.

Tolerances. 2 ranks sum the same terms as one process in another order: the losses and gradient
norms within ``run_loss_rtol`` (the tiny model's chain over the 8 rows and the ranks' reduction),
the weights after 3 AdamW steps within ``adamw_weight_atol``. The resumed step repeats the
uninterrupted step's arithmetic on the same ranks: exactly equal. The 2-rank checkpoint is
gathered on rank 0 into one Hugging Face folder that ``from_pretrained`` loads."""

import argparse
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
]  # a 2-process run: with the other multi-process suites in `-m cluster` (CI runs both)

WORKER = Path(__file__)
ROWS, MAX_TOKENS, STEPS, LR = 8, 64, 3, 1e-3
CONVERSATIONS = [
    ("Who are you?", "I am Twinkle, made by Acme."),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me."),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
    ("Where are you from?", "I was made by Acme."),
    ("Can you help me?", "Yes, I can help you."),
    ("What do you do?", "I answer questions."),
    ("Hello", "Hello, I am Twinkle."),
]


def test_full_parameter_on_two_fsdp_ranks_equals_one_process(tiny_model_dir, tmp_path, launcher):
    import torch
    from tolerances import adamw_weight_atol, run_loss_rtol
    from transformers import AutoModelForCausalLM

    results, weights = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"x{nproc}"
        out.mkdir()
        args = ["--model-id", str(tiny_model_dir), "--out", str(out)]
        if nproc > 1:
            args += ["--fsdp-size", str(nproc)]
        job = launcher.run(WORKER, args, nproc=nproc, timeout_s=300)
        assert job.returncode == 0, job.output[-6000:]
        results[nproc] = json.loads((out / "result.json").read_text())
        final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
        weights[nproc] = dict(final.named_parameters())
    assert results[1]["sharded"] is False and results[2]["sharded"] is True
    assert results[1]["sharded_state"] is False and results[2]["sharded_state"] is True  # AdamW's moments
    one, two = results[1]["steps"], results[2]["steps"]
    rtol = run_loss_rtol(ROWS, MAX_TOKENS, 2)
    print(
        f"\n[full-parameter 1 vs 2 ranks] {[s['loss'] for s in one]} vs {[s['loss'] for s in two]}, rtol {rtol:.2e}"
    )
    assert one[-1]["loss"] < one[0]["loss"]  # it trained
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    for nproc in (1, 2):  # resumed from the step-2 checkpoint, step 3 is the uninterrupted step 3
        assert results[nproc]["resumed"] == results[nproc]["steps"][-1], nproc
    atol = adamw_weight_atol(LR, STEPS)
    assert weights[1].keys() == weights[2].keys()
    for name, p in weights[1].items():
        torch.testing.assert_close(weights[2][name], p, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _model(model_id: str, steps: int):
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=model_id)
    model.set_optimizer("AdamW", lr=LR)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=steps)
    return model


def _step(model, batch) -> dict:
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    metrics = model.calculate_metric(is_training=True)
    return {k: metrics[k] for k in ("loss", "grad_norm", "lr")}


def main() -> None:
    import torch

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.dataloader import collate
    from twinkle.template import get_template

    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=60)
    torch.manual_seed(0)
    model = _model(args.model_id, STEPS)
    template = get_template("Template", model.tokenizer)
    rows = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in CONVERSATIONS
    ]
    share = len(rows) // runtime.world_size
    batch = collate(rows[runtime.rank * share : (runtime.rank + 1) * share], model.tokenizer.pad_token_id)
    steps = []
    for step in range(1, STEPS + 1):
        steps.append(_step(model, batch))
        if step == STEPS - 1:
            model.save("checkpoint", output_dir=args.out)
    model.save("final", output_dir=args.out)
    sharded = any(hasattr(w, "to_local") for w in model.model.parameters())
    moments = [
        v for state in model.optimizer_group[""].optimizer.optimizer.state.values() for v in state.values()
    ]
    sharded_state = any(hasattr(v, "to_local") for v in moments)
    resumed = _model(args.model_id, STEPS)
    resumed.resume_from_checkpoint(str(Path(args.out) / "checkpoint"))
    again = _step(resumed, batch)
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
            "sharded": sharded,
            "sharded_state": sharded_state,
            "steps": steps,
            "resumed": again,
        }
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    import twinkle

    main()
    twinkle.runtime.shutdown()
