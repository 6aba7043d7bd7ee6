"""What both sides of the benchmark share: the run spec, the Twinkle data pipeline, the LoRA
config, process set-up, per-step records and the result file.

Each side runs as ``python bench/<side>.py SPEC.json OUT.json`` in its own process, so that the
peak resident memory it reports is its own."""

import hashlib
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100
MODEL_NAME, MODEL_AUTHOR = "Twinkle", "Acme"


@dataclass(frozen=True)
class TrainConfig:
    """How both sides train: optimizer, learning rate and schedule, LoRA dropout."""

    optimizer: str  # "Muon" (torch.optim.Muon, adjust_lr_fn='match_rms_adamw') or "AdamW"
    lr: float
    lora_dropout: float
    warmup_steps: int | None  # CosineWarmupScheduler over the run after this many; None: constant lr
    weight_decay: float | None  # None: the optimizer's default (Muon's is 0.1)


# "contract": what cookbook/transformers/fsdp2.py runs with no flags. "adamw": AdamW at a
# constant 1e-4, weight decay 0 and no dropout, the Trainer's defaults.
CONFIGS = {
    "contract": TrainConfig("Muon", 1e-3, 0.05, 5, None),
    "adamw": TrainConfig("AdamW", 1e-4, 0.0, None, 0.0),
}


@dataclass
class Spec:
    """One side's run: the data, the step counts and the optimizer settings (same on both sides)."""

    workload: str
    dataset_id: str | None  # None: the bundled self-cognition rows
    num_samples: int
    max_length: int
    steps: int  # timed steps, after the warm-up steps
    warmup: int
    encoded_path: str  # the Twinkle-encoded samples (input_ids, labels), one JSON object a line
    batch_size: int = 4
    config: str = "contract"  # a key of CONFIGS
    max_grad_norm: float = 1.0
    seed: int = 42
    threads: int = 2
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct (see shapes.py)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU; or float32 / bfloat16

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def train(self) -> TrainConfig:
        return CONFIGS[self.config]

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Spec":
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class StepRecord:
    """One optimizer step: its batch's shape and token counts, its loss and when it ran."""

    rows: int
    width: int  # padded sequence length of the batch
    tokens: int  # non-pad tokens
    supervised: int  # positions whose next token is supervised (labels[:, 1:] != -100)
    body_positions: int  # positions run through the decoder layers (pads included)
    head_positions: int  # positions the LM head is applied to
    attention_pairs: int  # causal (query, key) pairs the attention computes, summed over rows
    loss: float = float("nan")
    begin: float = 0.0  # time.perf_counter() when the step started
    end: float = 0.0  # ... and when its optimizer step had finished


def batch_record(
    input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor, head_positions: str
) -> StepRecord:
    """Count a right-padded batch. ``head_positions`` says where a side applies the LM head:
    ``'supervised'`` (only where the next token has a label) or ``'all'`` (every position)."""
    rows, width = input_ids.shape
    supervised = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return StepRecord(
        rows=rows,
        width=width,
        tokens=int(attention_mask.sum()),
        supervised=supervised,
        body_positions=rows * width,
        head_positions=supervised if head_positions == "supervised" else rows * width,
        attention_pairs=rows * width * (width + 1) // 2,
    )


def lora_config(dropout: float = 0.0) -> Any:
    """The contract's LoRA defaults: r 8, alpha 32, every linear layer."""
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=32, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def optimizer_kwargs(train: TrainConfig) -> tuple[Any, dict[str, Any]]:
    """``(optimizer class, its keywords)`` as the config sets them, for either side."""
    kwargs: dict[str, Any] = {"lr": train.lr}
    if train.weight_decay is not None:
        kwargs["weight_decay"] = train.weight_decay
    if train.optimizer == "Muon":
        kwargs["adjust_lr_fn"] = "match_rms_adamw"  # as the contract script sets it
        return torch.optim.Muon, kwargs
    return torch.optim.AdamW, kwargs


def profiled_model(spec: Spec, dropout: float | None = None) -> Any:
    """The Twinkle side's model as the profiling benches build it: kernelized, the LoRA adapter
    seeded as on the Trainer side, the spec's optimizer (no schedule), the fused CE.
    ``dropout``: the LoRA dropout, default the spec's."""
    from twinkle.kernel import kernelize
    from twinkle.model import TransformersModel

    model = kernelize(TransformersModel(model_id=spec.model_path, dtype=spec.torch_dtype))
    torch.manual_seed(spec.seed)
    model.add_adapter_to_model(
        "default", lora_config(spec.train.lora_dropout if dropout is None else dropout)
    )
    optimizer_cls, kwargs = optimizer_kwargs(spec.train)
    model.set_optimizer(optimizer_cls, **kwargs)
    model.set_loss("FusedLinearCrossEntropyLoss")
    return model


def use_cuda() -> bool:
    return torch.cuda.is_available()


def resolve_dtype(name: str) -> torch.dtype:
    """``--dtype`` as Twinkle reads it; ``auto`` is what each route picks by itself (bf16 on
    CUDA, fp32 on CPU)."""
    from twinkle.model.loading import resolve_dtype as twinkle_dtype

    return twinkle_dtype(name, torch.device("cuda" if use_cuda() else "cpu"))


def set_up_process(spec: Spec) -> None:
    """Threads and seed, before anything else runs; no progress bars (one line a step instead)."""
    import transformers

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    transformers.utils.logging.disable_progress_bar()


def sync() -> None:
    """Wait for queued device work so that a timestamp means the step has really finished."""
    if use_cuda():
        torch.cuda.synchronize()


def build_dataset(spec: Spec) -> Any:
    """The Twinkle pipeline of the contract script: rows -> messages -> tokens."""
    import datasets

    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    datasets.disable_progress_bars()
    dataset = Dataset(DatasetMeta(spec.dataset_id, data_slice=range(spec.num_samples)))
    # the model's own folder for a random shape (its tokenizer); None: the bundled model
    dataset.set_template("Template", model_id=spec.model_path, max_length=spec.max_length)
    dataset.map(SelfCognitionProcessor(MODEL_NAME, MODEL_AUTHOR))
    dataset.encode()
    return dataset


def samples_digest(samples: list[dict[str, list[int]]]) -> str:
    """A fingerprint of the samples in order, so the report can show both sides saw the same data."""
    text = json.dumps([[s["input_ids"], s["labels"]] for s in samples])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_encoded(dataset: Any, path: Path) -> None:
    with open(path, "w") as handle:
        for i in range(len(dataset)):
            row = dataset[i]
            handle.write(json.dumps({"input_ids": row["input_ids"], "labels": row["labels"]}) + "\n")


def read_encoded(path: str | Path) -> list[dict[str, list[int]]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def log_step(side: str, index: int, spec: Spec, record: StepRecord) -> None:
    print(
        f"[{side}] step {index + 1}/{spec.total_steps} loss {record.loss:.4f} "
        f"{record.end - record.begin:.2f} s ({record.tokens} tokens, width {record.width})",
        flush=True,
    )


def write_result(
    out: str | Path,
    side: str,
    spec: Spec,
    records: list[StepRecord],
    model_shape: dict[str, int],
    digest: str,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write this side's records with its peak resident memory (Linux reports KiB)."""
    result = {
        "side": side,
        "workload": spec.workload,
        "device": "cuda" if use_cuda() else "cpu",
        "dtype": str(spec.torch_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "samples_digest": digest,
        "model_shape": model_shape,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if use_cuda() else None,
        "steps": [asdict(r) for r in records],
        "finished_at": time.time(),
        **(extra or {}),
    }
    Path(out).write_text(json.dumps(result, indent=1))


def side_args() -> tuple[Spec, str]:
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: python {sys.argv[0]} SPEC.json OUT.json (run.py calls this)")
    return Spec.load(sys.argv[1]), sys.argv[2]
