"""Sampling from a trainer sharded by FSDP2, for ``test_sampler_fsdp.py``.

Run as one process or under torchrun (``--fsdp-size 2``). Two sample calls, each with a share of
prompts per rank (one process: every share, one call each). The shares differ in how long they
generate (a prompt 3 positions short of the model's limit stops after 3 tokens) and one is
empty, so the ranks' forwards only line up if the sampler keeps them in lockstep. Each rank
writes ``OUT/rank-R.json``: per share (``call.rank``) its tokens, log-probabilities and stop
reasons, and the largest gap between those and ``forward_only``'s log-probabilities."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler


def calls(limit: int) -> list[list[list[dict]]]:
    """Two sample calls, each with one share of prompts per rank (2 ranks)."""
    chat = [{"messages": [{"role": "user", "content": "Who are you?"}]}]
    short = {"input_ids": [5] * (limit - 3)}  # 3 positions left: stops after 3 tokens
    other = {"messages": [{"role": "user", "content": "Paris France"}]}
    return [[chat, [short, other]], [[other], []]]


def sample_share(model, sampler, rows: list[dict]) -> dict:
    params = SamplingParams(max_tokens=8, seed=4, num_samples=2)
    sequences = [s for r in sampler.sample(rows, params) for s in r.sequences]
    feats = [s.new_input_feature for s in sequences] or [{"input_ids": [0], "labels": [-100]}]
    logps = model.forward_only(inputs=feats)["logps"]  # a collective: every rank calls it once
    gap = 0.0
    for i, s in enumerate(sequences):
        n, length = len(s.tokens), len(s.new_input_feature["input_ids"])
        mine = torch.tensor([e[0][1] for e in s.logprobs])
        gap = max(gap, float((logps[i, length - n : length] - mine).abs().max()))
    return {
        "tokens": [s.tokens for s in sequences],
        "logprobs": [[e[0][1] for e in s.logprobs] for s in sequences],
        "reasons": [s.stop_reason for s in sequences],
        "gap": gap,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp-size", type=int, default=None)
    args = p.parse_args()
    mesh = DeviceMesh.from_sizes(fsdp_size=args.fsdp_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=30)
    model = TransformersModel(model_id=args.model_id, dtype=torch.float32)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    sampler = TorchSampler(model)
    results = {}
    for c, shares in enumerate(calls(model.model.config.max_position_embeddings)):
        ranks = range(len(shares)) if runtime.world_size == 1 else [runtime.rank]
        for r in ranks:
            results[f"{c}.{r}"] = sample_share(model, sampler, shares[r])
    Path(args.out, f"rank-{runtime.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
