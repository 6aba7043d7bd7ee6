"""Routing replay on DeepSeek-V4 under expert parallelism, on 2 gloo ranks (ep_size 2 over 2 FSDP2
shards) against one process, on the expert parallelism test's tiny checkpoint (3 MoE layers of 8
experts, top-2: the first hash-routed by its token table, the others scored; experts whose SwiGLU
clamps at ``swiglu_limit``).

The script below (run as ``__main__``, one process or under torchrun with ``--ep-size 2``) first
records the routers' own choices on each rank's rows and replays them (the plain forward's logps,
bit for bit), then trains 3 LoRA steps (attention and the experts) replaying fixed routes that
neither router chose: a function of each token id and layer, at every layer, the hash-routed one
too, so many tokens run through experts on the other rank. Each rank checks that every training
forward ran exactly the replayed experts; rank 0 writes the per-step losses and gradient norms and
a replayed evaluation's logps, which agree with one process's within ``run_loss_rtol``
(``tests/assets/tolerances.py``), and how far replay moved the logps (far past that bound)."""

import argparse
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

STEPS, EXPERTS, LAYERS = 3, 8, 3


def fixed_routes(ids: list[int]) -> torch.Tensor:
    """``(tokens, LAYERS, 2)`` distinct experts per token and layer, from the token id alone."""
    tokens = torch.tensor(ids)[:, None]
    layer = torch.arange(LAYERS)[None]
    first = (tokens * 5 + layer) % EXPERTS
    second = (first + 1 + tokens % (EXPERTS - 1)) % EXPERTS
    return torch.stack([first, second], dim=-1)


def main() -> None:
    from ep_worker import rows
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.model import TransformersModel
    from twinkle.model.transformers.moe.router_replay import RouterReplayAction

    record, replay = RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD
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
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_b_proj", "o_b_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    lora.init_lora_weights = False  # B random too: every LoRA weight has a gradient from the first step
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-2)
    encoded = rows(model.tokenizer)
    share = len(encoded) // mesh.data_world_size
    mine = encoded[mesh.data_rank * share : (mesh.data_rank + 1) * share]

    plain = model.forward_only(inputs=mine)["logps"]
    recorded = model.forward_only(inputs=mine, router_replay_action=record)["routed_experts"]
    own = [dict(row, routed_experts=r) for row, r in zip(mine, recorded, strict=True)]
    if not torch.equal(model.forward_only(inputs=own, router_replay_action=replay)["logps"], plain):
        raise AssertionError(f"rank {runtime.rank}: the routers' own routes replayed gave other logps")
    targets = [fixed_routes(row["input_ids"]) for row in mine]
    replayed = [dict(row, routed_experts=t) for row, t in zip(mine, targets, strict=True)]
    before = model.forward_only(inputs=replayed, router_replay_action=replay)
    moved = float((before["logps"] - plain).abs().max())
    steps = []
    for _ in range(STEPS):
        model.forward_backward(inputs=replayed, router_replay_action=replay)
        ran = model.router_replay.recorded_routes()  # the experts the training forward ran
        for i, target in enumerate(targets):
            if not torch.equal(ran[i, : len(target)], target):
                raise AssertionError(f"rank {runtime.rank}: row {i} ran other experts than the replayed ones")
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({k: metric[k] for k in ("loss", "grad_norm", "samples", "supervised_tokens")})
    evaluated = model.forward_only(inputs=replayed, router_replay_action=replay)
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
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


def test_deepseek_v4_replay_under_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    from test_ep_deepseek_v4 import build_deepseek_v4
    from tolerances import run_loss_rtol

    routes = fixed_routes(list(range(64)))
    assert bool((routes[..., 0] != routes[..., 1]).all())  # 2 distinct experts per token and layer
    model_dir = build_deepseek_v4(tiny_model_dir, tmp_path / "deepseek_v4")
    one = _run(launcher, model_dir, tmp_path / "one", 1)
    two = _run(launcher, model_dir, tmp_path / "two", 2)
    assert two["world_size"] == 2
    lengths = one["lengths"]
    rtol = run_loss_rtol(len(lengths), max(lengths), 2)
    assert min(one["moved"], two["moved"]) > 10 * rtol  # replay changed what the model computes
    print(
        f"\n[ep 2, replay, deepseek_v4] losses {[s['loss'] for s in one['steps']]} vs "
        f"{[s['loss'] for s in two['steps']]}, moved {one['moved']:.2e}, rtol {rtol:.2e}"
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
