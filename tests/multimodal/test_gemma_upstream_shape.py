"""Upstream's Gemma 4 LaTeX-OCR recipe (``cookbook/mm/fsdp2_gemma4_mm.py``): its calls, in its
order, on a tiny random Gemma 4 (``tiny_gemma_vl.py``) and a few generated pictures with their
text, in a process of their own: ``CLI.from_args`` with upstream's flags (``--template-cls
Gemma4Template``), ``DeviceMesh.from_sizes(..., ep_size=, device_type=)``, a ``Preprocessor``
building ``Message(role='user', content='<image>...', images=[row['image']])``,
``AutoConfig.from_pretrained(..., return_unused_kwargs=True)``, ``TransformersModel(model_id=,
config=, device_mesh=, strategy=, ignore_mismatched_sizes=, fsdp_config={'reshard_after_forward':
True, 'expert_parallel': {...}})`` (no ``model_cls``: the auto class loads the VL model), LoRA,
optimizer and schedule from the flags, training steps with their metric and an evaluation of
``forward_only`` + ``calculate_loss``.

One call differs: upstream builds ``Dataset`` and calls ``encode()``; the recipe here runs with
``LazyDataset`` (rows encoded when read). A Gemma 4 image row holds its patches padded to the
image processor's budget (with its defaults, 280 soft tokens of 3x3 pooled 16-pixel patches: 2520 x
768 float32 values, 7.4 MiB), so the recipe's 2000 training rows would hold about 14 GiB: here
``Dataset.encode()`` keeps each row's picture and a read makes its patches, equal to
``LazyDataset``'s (the last test)."""

import json

import pytest
import warm
from harness import script_env
from tiny_gemma_vl import build_tiny_gemma4
from tiny_qwen3_vl import picture

RECIPE = """
import sys
from peft import LoraConfig
from transformers import AutoConfig, Gemma4Config

import twinkle
from twinkle import DeviceMesh, Platform, get_logger
from twinkle.cli import CLI
from twinkle.data_format import Message, Trajectory
from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.model import TransformersModel
from twinkle.preprocessor import Preprocessor

args = CLI.from_args(sys.argv[1:])
mesh = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size,
                             ep_size=args.infra.ep_size, device_type=Platform.get_platform().device_prefix())
twinkle.initialize(mode=args.infra.mode, global_device_mesh=mesh)


class OCR(Preprocessor):
    def __call__(self, rows):
        rows = [self.row(r) for r in self.map_col_to_row(rows)]
        return self.map_row_to_col(rows)

    def row(self, row):
        return Trajectory(messages=[
            Message(role="user", content="<image>Read the formula.", images=[row["image"]]),
            Message(role="assistant", content=row["text"]),
        ])


def loader(samples):
    data = LazyDataset(dataset_meta=DatasetMeta(args.dataset.dataset_id, data_slice=range(samples)))
    data.set_template(args.template.template_cls, model_id=args.model.model_id)
    data.map(preprocess_func=OCR)
    data.encode()
    return DataLoader(dataset=data, batch_size=args.training.batch_size)


train = loader(args.training.train_samples)
config, _ = AutoConfig.from_pretrained(args.model.model_id, trust_remote_code=True, return_unused_kwargs=True)
assert isinstance(config, Gemma4Config)
config.use_cache = False
model = TransformersModel(model_id=args.model.model_id, config=config, device_mesh=mesh,
                          strategy=args.model.strategy, ignore_mismatched_sizes=True,
                          fsdp_config={"reshard_after_forward": True, "expert_parallel": {
                              "enabled": True, "router_dtype": "fp32", "keep_router_logits": False}})
model.add_adapter_to_model(args.lora.adapter_name, LoraConfig(**args.get_lora_args()),
                           gradient_accumulation_steps=args.training.gradient_accumulation_steps)
model.set_optimizer(optimizer_cls=args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
model.set_lr_scheduler(scheduler_cls=args.scheduler.scheduler_cls,
                       num_warmup_steps=args.scheduler.num_warmup_steps, num_training_steps=len(train))
print("class", type(model.model.get_base_model()).__name__)
print("configs", model.get_train_configs())
for step, batch in enumerate(train):
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    print("train", step, model.calculate_metric(is_training=True)["loss"])
for batch in loader(args.training.eval_samples):
    model.forward_only(inputs=batch)
    model.calculate_loss()
print("eval", model.calculate_metric(is_training=False)["loss"])
"""


@pytest.fixture(scope="module")
def ocr(tmp_path_factory):
    """``(checkpoint, rows file)``: a tiny Gemma 4 and 8 pictures of different sizes with text."""
    root = tmp_path_factory.mktemp("gemma4-ocr")
    folder = build_tiny_gemma4(root / "model")
    lines = []
    for i in range(8):
        path = root / f"{i}.png"
        path.write_bytes(picture((32 + 8 * i, 32), (20 * i, 200, 30)))
        lines.append(json.dumps({"image": str(path), "text": f"x^{i} + {i}"}))
    rows = root / "latex.jsonl"
    rows.write_text("\n".join(lines) + "\n")
    return folder, rows


@pytest.mark.slow  # a subprocess that loads, trains and evaluates: over 10 s
def test_the_recipe_trains_and_evaluates(ocr, tmp_path):
    folder, rows = ocr
    script = tmp_path / "recipe.py"
    script.write_text(RECIPE)
    flags = ["--model-id", str(folder), "--dataset-id", str(rows), "--template-cls", "Gemma4Template",
             "--batch-size", "2", "--lr", "1e-3", "--train-samples", "6", "--eval-samples", "2"]  # fmt: skip
    # its own process, forked from one that has imported torch and transformers (warm.py)
    done = warm.run([str(script), *flags], cwd=tmp_path, env=script_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout.splitlines()
    assert "class Gemma4ForConditionalGeneration" in out
    losses = [float(line.split()[-1]) for line in out if line.startswith("train ")]
    assert len(losses) == 3 and all(0 < v < 20 for v in losses), out
    assert [line for line in out if line.startswith("eval ")], out


def test_dataset_encode_with_images_reads_as_lazy_dataset(ocr):
    import torch

    from twinkle.data_format import Message, Trajectory
    from twinkle.dataset import Dataset, DatasetMeta, LazyDataset

    folder, rows = ocr

    def preprocess(row):
        user = Message(role="user", content="<image>Read the formula.", images=[row["image"]])
        return Trajectory(messages=[user, Message(role="assistant", content=row["text"])])

    read = []
    for cls in (Dataset, LazyDataset):
        data = cls(dataset_meta=DatasetMeta(str(rows), data_slice=range(2)))
        data.set_template("Gemma4Template", model_id=str(folder))
        data.map(preprocess).encode()
        read.append([data[i] for i in range(2)])
    for eager, lazy in zip(*read, strict=True):
        assert sorted(eager) == sorted(lazy) and "pixel_values" in eager
        for key, value in eager.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == lazy[key].dtype and torch.equal(value, lazy[key]), key
            else:
                same = list(value) == list(lazy[key]) if isinstance(value, list) else value == lazy[key]
                assert same, key
