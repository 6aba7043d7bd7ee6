"""Two adapters on one FSDP2-sharded base, for ``test_multi_lora_fsdp.py``.

Under torchrun (``--fsdp-size N``): adapters ``a`` (r 8, AdamW, window of 2) and ``b`` (r 4, Muon,
another lr), both with dropout, train interleaved a, b, a, b on a model of ``max_loras`` 2; then
each trains alone in a model of its own, one after the other, on the same data. Rank 0 writes
``OUT/result.json``: the largest difference between the interleaved and the solo weights and
optimizer states of each adapter, whether b's probe log-probs stayed bit-identical across a's
steps, and the saved folders of both adapters (one PEFT adapter each)."""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import MultiLoraTransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

SPECS = {
    "a": (dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear"), 2, "AdamW", 1e-2, {}),
    "b": (
        dict(r=4, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]),
        1,
        "Muon",
        2e-2,
        {"adjust_lr_fn": "match_rms_adamw"},
    ),
}


def build(model_id: str, names: list[str]) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(model_id, max_loras=2, max_r=8)
    for name in names:
        config, gas, optimizer, lr, kwargs = SPECS[name]
        model.add_adapter_to_model(name, LoraConfig(**config), gradient_accumulation_steps=gas)
        model.set_optimizer(optimizer, lr=lr, adapter_name=name, **kwargs)
    return model


def state(model, name: str) -> dict[str, torch.Tensor]:
    """The adapter's full weights and its optimizer's tensors (a collective: every rank calls it)."""
    out = {f"w/{k}": v for k, v in model.get_state_dict(adapter_name=name).items()}
    for index, values in model.optimizer_group[name].optimizer.state_dict()["state"].items():
        out.update({f"o/{index}/{k}": v for k, v in values.items() if torch.is_tensor(v)})
    return out


def step(model, name: str, batch) -> None:
    model.forward_backward(inputs=batch, adapter_name=name)
    model.clip_grad_and_step(adapter_name=name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    runtime = twinkle.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(), timeout_s=30)
    dataset = Dataset(DatasetMeta(None, data_slice=range(4 * args.steps)))
    dataset.set_template("Template", model_id=args.model_id, max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    batches = list(DataLoader(dataset=dataset, batch_size=4))
    together = build(args.model_id, ["a", "b"])
    same_probe = True
    for i, batch in enumerate(batches):
        together.forward_only(batches[0], adapter_names=["b"] * len(batches[0]))
        before = together.last_outputs["logps"].clone()
        step(together, "a", batch)
        together.forward_only(batches[0], adapter_names=["b"] * len(batches[0]))
        same_probe = same_probe and torch.equal(before, together.last_outputs["logps"])
        step(together, "b", batches[-1 - i])
    diffs = {}
    for name in ("a", "b"):
        solo = build(args.model_id, [name])
        for i, batch in enumerate(batches):
            step(solo, name, batch if name == "a" else batches[-1 - i])
        ours, theirs = state(together, name), state(solo, name)
        assert ours.keys() == theirs.keys()
        diffs[name] = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
        moved = max(v.abs().max().item() for k, v in ours.items() if "lora_B" in k)
        diffs[f"{name}_moved"] = moved
    folders = {n: str(together.save(f"{n}-final", output_dir=str(out), adapter_name=n)) for n in ("a", "b")}
    if runtime.rank == 0:
        result = {
            "world_size": runtime.world_size,
            "diffs": diffs,
            "same_probe": same_probe,
            "folders": folders,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
