"""A single-controller driver for the tests (``test_ray_controller.py``): a model group of two
CPU ranks (FSDP2, gloo) trained from the driver's loop, printing one JSON line per result.

    python controller_driver.py MODEL_DIR OUT_DIR MODE [RAY_ADDRESS]

MODE ``train``: three ``forward_backward`` + ``clip_grad_and_step`` steps on global batches of
4 rows the driver's DataLoader yields (sliced to the ranks), then ``calculate_metric`` and
``save``; ``loader``: the same steps with the DataLoader on the model's group (each rank's
batch stays in its process); ``kill``: prints the group's pids, then steps until a rank dies
(the test kills one); ``oversize``: a group of 64 CPU ranks; ``sync``: a model group of one
rank sends its LoRA weights to a ``sink`` group of one rank (``sync_weights``); ``engine``: the
same with a ``TorchSampler`` group and ``CheckpointEngineManager`` (LoRA, merged, LoRA again)."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from shared_data import build_dataset  # noqa: E402

import twinkle  # noqa: E402
from twinkle import DeviceGroup, DeviceMesh  # noqa: E402
from twinkle.dataloader import DataLoader  # noqa: E402
from twinkle.model import TransformersModel  # noqa: E402
from twinkle.runtime import RunDefaults  # noqa: E402
from twinkle.runtime.remote import remote_class, sync_weights  # noqa: E402

STEPS, BATCH = 3, 4


def lora() -> LoraConfig:
    return LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )


@remote_class
class Sink:
    """Receives weights and answers with what it got: each tensor's name, shape and sum."""

    def receive(self, weights: dict) -> dict:
        return {name: [list(t.shape), float(t.double().sum())] for name, t in weights.items()}


def sync(model_dir: str) -> None:
    model = TransformersModel(model_dir, remote_group="model")
    model.add_adapter_to_model("default", lora())
    received = sync_weights(model, Sink(remote_group="sink"), "receive")
    sent = {name: [list(t.shape), float(t.double().sum())] for name, t in model.get_state_dict().items()}
    print(json.dumps({"sent": sent, "received": received}))


def engine_syncs(model: object, sampler: object) -> list[dict]:
    """LoRA weights, merged weights, then LoRA again (the plain base weights go back first)."""
    from twinkle.checkpoint_engine import CheckpointEngineManager

    manager = CheckpointEngineManager(model, sampler)
    return [manager.sync_weights(), manager.sync_weights(merge_and_sync=True), manager.sync_weights()]


def engine(model_dir: str) -> None:
    from twinkle.sampler.torch_sampler import TorchSampler

    model = TransformersModel(model_dir, remote_group="model")
    model.add_adapter_to_model("default", lora())
    sampler = TorchSampler(model_dir, remote_group="sampler")
    print(json.dumps({"syncs": engine_syncs(model, sampler)}))


def main() -> None:
    model_dir, out_dir, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    address = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    ranks = {"oversize": 64, "sync": 1, "engine": 1}.get(mode, 2)
    mesh = DeviceMesh(fsdp_size=2, dp_size=1)
    groups = [DeviceGroup(name="model", ranks=ranks, device_type="CPU")]
    if mode in ("sync", "engine"):
        groups.append(DeviceGroup(name="sink" if mode == "sync" else "sampler", ranks=1, device_type="CPU"))
    twinkle.initialize(mode="ray", groups=groups, run=RunDefaults(ray_address=address))
    if mode in ("sync", "engine"):
        return sync(model_dir) if mode == "sync" else engine(model_dir)
    dataset = build_dataset(model_dir, BATCH * STEPS)
    group = "model" if mode == "loader" else None
    loader = DataLoader(dataset=dataset, batch_size=BATCH, device_mesh=mesh, remote_group=group)
    model = TransformersModel(model_dir, device_mesh=mesh, remote_group="model")
    model.add_adapter_to_model("default", lora())
    model.set_optimizer("AdamW", lr=1e-2)
    if mode == "kill":
        print(json.dumps({"pids": [p[2] for p in twinkle.runtime.controller.active().group("model").places]}))
        sys.stdout.flush()
        while True:
            for batch in loader:
                model.forward_backward(inputs=batch)
                model.clip_grad_and_step()
                time.sleep(0.05)
    losses = []
    for batch in loader:
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
    evaluated = model.forward_only(inputs=batch)  # each rank's outputs stay there (Sharded)
    outputs = {
        "loss": evaluated["loss"],
        "num_tokens": evaluated["num_tokens"],
        "rows": len(evaluated["logps"]),
    }
    metric = model.calculate_metric(is_training=True)
    saved = model.save("final", output_dir=str(out_dir))
    print(
        json.dumps(
            {"losses": losses, "metric": metric, "saved": str(saved), "len": len(loader), "outputs": outputs}
        )
    )
    print(twinkle.get_device_placement())


if __name__ == "__main__":
    main()
