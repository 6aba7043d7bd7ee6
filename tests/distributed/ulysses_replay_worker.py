"""Routing replay with Ulysses sequence parallelism, for ``test_ulysses_replay.py``.

Run it as one process, or under torchrun with ``--ulysses-size 2``: both ranks read every row of
4 chat samples (one longer than half the packed row, so its tokens lie on both ranks' shares)
and each runs half of the positions of the packed row through a tiny Qwen3-MoE.

1. ``RouterReplayAction.RECORD``: the router's own choices, gathered back into whole rows (every
   rank returns them); replayed at once (``REPLAY_FORWARD``), they give the plain forward's
   log-probabilities exactly, which they do only where each rank's routes are in their places.
   The same on the padded batch (``padding_free`` off for these two passes).
2. 2 LoRA steps replaying fixed routes: the recorded experts shifted by 3 (mod 8), experts the
   router did not choose, so replay is what decides them; after each training forward every
   rank checks that the forward ran exactly those experts (``recorded_routes``, gathered).
3. An evaluation replaying the same routes.

Each rank writes ``OUT/result-RANK.json``: the recorded routes (packed and padded passes), the
largest change replay made to the logps, the per-step loss, gradient norm and counts, and the
evaluation's logps."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from sp_worker import QUESTIONS, rows

import twinkle
from twinkle import DeviceMesh
from twinkle.model import TransformersModel
from twinkle.model.transformers.moe.router_replay import RouterReplayAction

RECORD, REPLAY = RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD
STEPS, EXPERTS, SHIFT = 2, 8, 3


def _with_routes(encoded: list[dict], routes: torch.Tensor) -> list[dict]:
    return [dict(row, routed_experts=r) for row, r in zip(encoded, routes, strict=True)]


def _own_routes_replay_exactly(
    model: TransformersModel, encoded: list[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's own choices, recorded, and the plain logps, which replaying them gives bit for
    bit."""
    plain = model.forward_only(inputs=encoded)["logps"]
    recorded = model.forward_only(inputs=encoded, router_replay_action=RECORD)["routed_experts"]
    again = model.forward_only(inputs=_with_routes(encoded, recorded), router_replay_action=REPLAY)
    if not torch.equal(again["logps"], plain):
        raise AssertionError("the recorded routes replayed gave other logps than the plain forward")
    if not torch.equal(again["routed_experts"], recorded):
        raise AssertionError("the replayed forward ran other experts than the recorded ones")
    return recorded, plain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ulysses-size", type=int, default=None)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(ulysses_size=args.ulysses_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(model_id=args.model_id, dtype=torch.float32, enable_router_replay=True)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    lora.init_lora_weights = False  # B random too: every LoRA weight has a gradient from the first step
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-2)
    encoded = rows(model.tokenizer, QUESTIONS)  # every rank reads every row

    model.padding_free = False  # the padded batch: each rank runs a share of every row
    padded = _own_routes_replay_exactly(model, encoded)[0]
    model.padding_free = True  # the packed row
    recorded, plain = _own_routes_replay_exactly(model, encoded)

    ran = recorded >= 0
    targets = torch.where(ran, (recorded + SHIFT) % EXPERTS, recorded)  # experts the router did not choose
    replayed = _with_routes(encoded, targets)
    before = model.forward_only(inputs=replayed, router_replay_action=REPLAY)
    moved = float((before["logps"] - plain).abs().max())
    steps = []
    for _ in range(STEPS):
        model.forward_backward(inputs=replayed, router_replay_action=REPLAY)
        if not torch.equal(model.router_replay.recorded_routes(), targets):
            raise AssertionError(
                f"rank {runtime.rank}: the training forward ran other experts than the replayed"
            )
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True)
        steps.append({k: metric[k] for k in ("loss", "grad_norm", "samples", "supervised_tokens")})
    evaluated = model.forward_only(inputs=replayed, router_replay_action=REPLAY)
    if not torch.equal(evaluated["routed_experts"], targets):
        raise AssertionError(f"rank {runtime.rank}: the evaluation ran other experts than the replayed")
    result = {
        "world_size": runtime.world_size,
        "recorded": recorded.tolist(),
        "padded": padded.tolist(),
        "moved": moved,
        "steps": steps,
        "logps": evaluated["logps"].tolist(),
        "lengths": [len(r["input_ids"]) for r in encoded],
    }
    Path(args.out, f"result-{runtime.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
