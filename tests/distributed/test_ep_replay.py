"""Routing replay under expert parallelism, on 2 gloo ranks (ep_size 2 over 2 FSDP2 shards) against
one process, for a tiny Qwen3-MoE (2 layers of 8 experts, top-2), a tiny DeepSeek-V3 (2 MoE
layers of 8 experts in 2 groups, top-2, a bias correction and a shared expert) and a tiny gpt-oss
(2 layers of 8 biased experts, top-2, a softmax over the chosen logits).

Replay rewrites each router's top-k choice on the rank's own tokens, and the exchange then sends
each token to the rank holding the replayed expert, a global id as recorded; so the combination
needs nothing of its own, and this shows it does what one process does. The script below (run as
``__main__``, one process or under torchrun with ``--ep-size 2``) first records the router's own
choices (``RouterReplayAction.RECORD``), then trains 3 LoRA steps (attention and the experts)
replaying fixed routes: the recorded experts shifted by 3 (mod 8), so every token runs through
experts its router did not choose, many of them on the other rank (their log-probabilities move
far past the bound, so replay is what decides them). Each rank checks that every
training forward ran exactly the replayed experts; rank 0 writes the recorded routes of its rows,
the per-step losses and gradient norms and a replayed evaluation's logps, which agree with one
process's within ``run_loss_rtol`` (``tests/assets/tolerances.py``); the recorded routes are equal."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

STEPS, EXPERTS, SHIFT = 3, 8, 3
QUESTIONS = [
    ("Who are you?", "I am Twinkle, a helpful assistant made by Acme. " * 3),
    ("What is your name?", "Twinkle"),
    ("Who made you?", "Acme made me, in Paris France. " * 2),
    ("Are you a helpful assistant?", "Yes, I am Twinkle, a helpful assistant."),
]


def _real(routes: torch.Tensor) -> torch.Tensor:
    """One padded row's routes at its real tokens (a pad's are ``NO_ROUTE``)."""
    return routes[routes[:, 0, 0] >= 0]


def main() -> None:
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.model import TransformersModel
    from twinkle.model.forward import causal_lm_of
    from twinkle.model.packing import can_pack
    from twinkle.model.transformers.moe.router_replay import RouterReplayAction
    from twinkle.template import get_template

    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ep-size", type=int, default=None)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ep_size=args.ep_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(
        model_id=args.model_id,
        dtype=torch.float32,
        activation_checkpointing="off",
        enable_router_replay=True,
        fsdp_config={"expert_parallel": {"enabled": True}},
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    lora.init_lora_weights = False  # B random too: every LoRA weight has a gradient from the first step
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-2)
    template = get_template("Template", model.tokenizer)
    encoded = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in QUESTIONS
    ]
    share = len(encoded) // mesh.data_world_size
    mine = encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share]

    plain = model.forward_only(inputs=mine, router_replay_action=RouterReplayAction.RECORD)
    recorded = plain["routed_experts"]
    own = [_real(r) for r in recorded]
    # every token the model ran: a packed row leaves out the last, which predicts nothing
    last = 0 if can_pack(causal_lm_of(model.model)) else 1  # DeepSeek-V3 runs the padded batch
    assert all(r.shape == (len(row["input_ids"]) - 1 + last, 2, 2) for r, row in zip(own, mine, strict=True))
    targets = [(r + SHIFT) % EXPERTS for r in own]  # experts the router did not choose
    rows = [dict(row, routed_experts=t) for row, t in zip(mine, targets, strict=True)]
    # the replayed routes move the log-probabilities: without replay the forward would run others
    before = model.forward_only(inputs=rows, router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    moved = float((before["logps"] - plain["logps"]).abs().max())
    steps = []
    for _ in range(STEPS):
        model.forward_backward(inputs=rows, router_replay_action=RouterReplayAction.REPLAY_FORWARD)
        ran = model.router_replay.recorded_routes()  # the experts the training forward ran
        for i, target in enumerate(targets):
            if not torch.equal(_real(ran[i]), target):
                raise AssertionError(f"rank {runtime.rank}: row {i} ran other experts than the replayed ones")
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({k: metric[k] for k in ("loss", "grad_norm", "samples", "supervised_tokens")})
    evaluated = model.forward_only(inputs=rows, router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    for i, target in enumerate(targets):
        assert torch.equal(_real(evaluated["routed_experts"][i]), target)
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
            "recorded": [r.tolist() for r in own],
            "moved": moved,
            "steps": steps,
            "logps": evaluated["logps"].tolist(),
            "lengths": [len(r["input_ids"]) for r in encoded],
        }
        Path(args.out, "result.json").write_text(json.dumps(result))


def _run(launcher, model_dir: Path, out: Path, nproc: int) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out)]
    if nproc > 1:
        args += ["--ep-size", "2"]
    job = launcher.run(Path(__file__), args, nproc=nproc, timeout_s=240)
    assert job.returncode == 0, job.output[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_replay_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher, family):
    from tolerances import run_loss_rtol

    sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
    from test_deepseek_gpt_oss_replay import build_deepseek_v3
    from test_ep_gpt_oss import build_gpt_oss
    from tiny_moe import build_qwen3_moe

    build = {"qwen3_moe": build_qwen3_moe, "deepseek_v3": build_deepseek_v3, "gpt_oss": build_gpt_oss}[family]
    model_dir = build(tiny_model_dir, tmp_path / family)
    one = _run(launcher, model_dir, tmp_path / "one", 1)
    two = _run(launcher, model_dir, tmp_path / "two", 2)
    assert two["world_size"] == 2
    # rank 0's rows: the router's own choices, recorded under expert parallelism, are one process's
    assert two["recorded"] == one["recorded"][: len(two["recorded"])]
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    assert min(one["moved"], two["moved"]) > 100 * rtol  # replay changed what the model computes
    print(
        f"\n[ep 2, replay, {family}] losses {[s['loss'] for s in one['steps']]} vs {[s['loss'] for s in two['steps']]}"
    )
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("samples", "supervised_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    for row_a, row_b in zip(one["logps"], two["logps"], strict=False):  # rank 0's rows
        for x, y in zip(row_a, row_b, strict=False):
            assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)


if __name__ == "__main__":
    main()
    import twinkle

    twinkle.runtime.shutdown()
