"""Typed argument groups and the ``Args`` container handed to user scripts.

Each group is a plain dataclass so that scripts get attribute access with types their editor
understands (``args.training.batch_size``). Parsing lives in ``parser.py``; this module only
declares fields, their defaults and the per-field metadata the parser needs (choices, bounds,
help, flag aliases). Field names are unique across groups, so one flag or ``TWINKLE_`` variable
maps to exactly one field, and a flat YAML config needs no group prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from twinkle.template.base import TRUNCATION_STRATEGIES
from twinkle.template.registry import TEMPLATES
from twinkle.utils.errors import UserError

from .declare import ADAPTER_NAME, AT_LEAST_0, AT_LEAST_1, POSITIVE, SEED, opt
from .post_training_args import CheckpointArgs, RLArgs, SamplerArgs, SamplingArgs

# The CLI rejects a typo before any model or tokenizer is loaded.
TEMPLATE_NAMES: tuple[str, ...] = tuple(TEMPLATES)


@dataclass
class InfraArgs:
    fsdp_size: int | None = opt(
        None, "FSDP shard group size; None infers it from the world size", check=AT_LEAST_1
    )
    dp_size: int | None = opt(None, "data-parallel replicate size; None infers it", check=AT_LEAST_1)
    mode: str = opt("local", "runtime backend", choices=("local", "ray"))
    seed: int = opt(42, "random seed, the same on every rank (so LoRA weights start identical)", check=SEED)
    debug: bool = opt(False, "show the full traceback of an error instead of one line")
    process_group_timeout: int = opt(600, "collective timeout in seconds", check=AT_LEAST_1)
    max_restarts: int = opt(
        0,
        "--mode ray: relaunch the workers this often after one dies, resuming from the latest checkpoint",
        check=AT_LEAST_0,
    )
    ray_address: str | None = opt(
        None,
        "--mode ray: the cluster to join (host:port or auto); None starts a local one (also $RAY_ADDRESS)",
    )
    ray_placement: str = opt(
        "pack",
        "--mode ray: place the workers on as few nodes as possible, or across nodes",
        choices=("pack", "spread"),
    )
    model_gpus: int | None = opt(
        None, "devices of the model group when a script places trainer and sampler apart", check=AT_LEAST_1
    )
    sampler_gpus: int | None = opt(
        None, "devices of the sampler group when a script places trainer and sampler apart", check=AT_LEAST_1
    )
    ref_model_gpus: int | None = opt(
        None, "devices of a separate reference model's group (a script's DPO placement)", check=AT_LEAST_1
    )
    # Upstream's parallel sizes. The parser accepts them so that a script can build its mesh from
    # them; a model that cannot run a size above 1 refuses it in one line
    # (``twinkle.model.parallel_sizes``), whether the script put it in its mesh or not.
    tp_size: int | None = opt(
        None, "tensor-parallel size (MegatronModel with megatron-core)", check=AT_LEAST_1
    )
    pp_size: int | None = opt(None, "pipeline stages (MegatronModel with megatron-core)", check=AT_LEAST_1)
    cp_size: int | None = opt(
        None, "context-parallel size (MegatronModel with megatron-core)", check=AT_LEAST_1
    )
    ep_size: int | None = opt(None, "expert-parallel size", check=AT_LEAST_1)
    ulysses_size: int | None = opt(None, "Ulysses sequence-parallel size", check=AT_LEAST_1)
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism (with tensor parallelism)")
    lazy_collect: bool = opt(
        True, "--mode ray: leave outputs on the ranks until the driver reads them (initialize(lazy_collect=))"
    )


@dataclass
class DatasetArgs:
    dataset_id: str | None = opt(None, "dataset path or ms:// / hf:// id; None = bundled self-cognition data")
    subset_name: str | None = opt(None, "dataset subset (config) name")
    split: str = opt("train", "dataset split")
    skip_bad_rows: bool = opt(
        False,
        "drop the rows that cannot be trained on (wrong value types, empty text, unknown roles, no assistant turn) and log how many and which, instead of stopping at the first",
    )


@dataclass
class TemplateArgs:
    template_cls: str = opt("Template", "chat template class", choices=TEMPLATE_NAMES)
    max_length: int = opt(1024, "maximum tokens per sample", check=AT_LEAST_1)
    truncation_strategy: str = opt(
        "right",
        "what to do with samples longer than max_length",
        choices=TRUNCATION_STRATEGIES,
    )
    default_system: str | None = opt(
        None, "system prompt added to conversations that have none (dataset.set_template(default_system=...))"
    )


@dataclass
class ModelArgs:
    model_id: str | None = opt(None, "model path or ms:// / hf:// id; None = bundled SmolLM2-135M-Instruct")
    enable_liger: bool = opt(
        False,
        "use the fused linear cross-entropy loss (Liger's name; our chunked version runs on every device); per-layer kernels come from kernelize regardless",
    )
    enable_fused_ce: bool = opt(
        True, "fused linear cross-entropy when Liger is enabled", aliases=("fused-ce",)
    )
    dtype: str = opt(
        "auto",
        "the model weights' dtype: auto (bfloat16 on GPU/NPU, float32 on CPU), float32, or bfloat16 (also on a CPU with native bf16 matmuls, AVX512-BF16 or AMX; LoRA weights stay float32)",
        choices=("auto", "float32", "bfloat16"),
    )
    activation_checkpointing: str = opt(
        "auto",
        "recompute decoder layers in backward: auto (only for a batch whose activations would not fit in free memory), on, off",
        choices=("auto", "on", "off"),
    )
    # native_fsdp is the default because upstream's scripts choose their Megatron path with
    # ``args.model.strategy != 'native_fsdp'``; by default they take the Transformers path.
    strategy: str = opt(
        "native_fsdp",
        "how several processes hold the model: native_fsdp or fsdp (FSDP2 over the mesh; also upstream's accelerate) or ddp (a whole model per rank, --fsdp-size 1)",
        choices=("fsdp", "native_fsdp", "accelerate", "ddp"),
    )
    model_cls: str | None = opt(
        None,
        "transformers class the weights load into, e.g. Qwen3_5ForConditionalGeneration; None = AutoModelForCausalLM",
        check=(str.isidentifier, "a transformers class name such as AutoModelForCausalLM"),
    )


@dataclass
class TrainingArgs:
    batch_size: int = opt(
        4, "global batch size per micro-step (split across data-parallel ranks)", check=AT_LEAST_1
    )
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step", check=AT_LEAST_1)
    train_samples: int | None = opt(
        None, "number of training samples; None = script default", check=AT_LEAST_1
    )
    eval_samples: int | None = opt(
        None, "number of evaluation samples; None = script default", check=AT_LEAST_1
    )
    log_interval: int = opt(5, "log metrics every N steps", check=AT_LEAST_1)
    eval_interval: int | None = opt(None, "evaluate every N steps; None = script default", check=AT_LEAST_1)
    output_dir: str = opt("output", "where checkpoints, metrics.jsonl and curves.png are written")
    report_to: str = opt(
        "none",
        "where metrics go besides OUTPUT_DIR/metrics.jsonl: none, tensorboard, wandb, swanlab (a comma list)",
    )
    resume_from_checkpoint: str | None = opt(
        None,
        "checkpoint folder to resume from, or auto|latest for the newest complete one under --output-dir",
    )
    resume_only_model: bool = opt(False, "restore adapter weights only, not optimizer/scheduler/RNG")
    ignore_data_skip: bool = opt(False, "on resume, restart the data from the beginning")
    max_steps: int | None = opt(
        None,
        "stop after N optimizer steps; None = one pass (read by the script's loop: sft_own_data.py, not fsdp2.py)",
        check=AT_LEAST_1,
    )
    save_steps: int | None = opt(
        None,
        "save a checkpoint every N optimizer steps (read by the script's loop: sft_own_data.py, not fsdp2.py)",
        check=AT_LEAST_1,
    )
    padding_free: bool = opt(
        True,
        "batches run packed into one row where the model allows it, with the padded loss; only true is accepted",
    )
    mini_batch_size: int | None = opt(
        None,
        "RL: samples per optimizer step within one batch of rollouts; None = the whole batch",
        check=AT_LEAST_1,
    )
    micro_batch_size: int | None = opt(
        None,
        "RL: samples per forward/backward within a mini-batch; None = the whole mini-batch",
        check=AT_LEAST_1,
    )


@dataclass
class LoraArgs:
    adapter_name: str = opt(
        "default", "name of the LoRA adapter: letters, digits, '_' and '-'", check=ADAPTER_NAME
    )
    lora_r: int = opt(8, "LoRA rank r", check=AT_LEAST_1, aliases=("r", "lora-rank"))
    lora_alpha: int = opt(32, "LoRA alpha (scaling = alpha / r)", check=AT_LEAST_1)
    lora_dropout: float = opt(0.05, "dropout on the LoRA input", check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    target_modules: str = opt("all-linear", "comma-separated module names, or 'all-linear'")
    lora_path: str | None = opt(None, "a saved LoRA adapter folder a script loads (e.g. to sample with it)")

    @property
    def lora_rank(self) -> int:
        """``lora_r`` under the name of its ``--lora-rank`` flag."""
        return self.lora_r

    @lora_rank.setter
    def lora_rank(self, value: int) -> None:
        self.lora_r = value


@dataclass
class OptimizerArgs:
    # 1e-3 suits LoRA on the small default model: at 1e-4 SmolLM2-135M had not learnt its new
    # name after 1000 self-cognition samples (eval loss 1.47). Lower it for larger models.
    learning_rate: float = opt(
        1e-3, "peak learning rate", check=POSITIVE, flag="lr", aliases=("learning-rate",)
    )
    optimizer_cls: str = opt(
        "AdamW", "optimizer for scripts that take it from the command line: a torch.optim name"
    )
    max_grad_norm: float = opt(
        1.0, "clip the gradients' global norm to this before each optimizer step", check=POSITIVE
    )


@dataclass
class SchedulerArgs:
    scheduler_cls: str = opt("CosineWarmupScheduler", "learning-rate scheduler class")
    num_warmup_steps: int = opt(
        5,
        "linear warm-up, in optimizer steps (one per --gradient-accumulation-steps micro-batches)",
        check=AT_LEAST_0,
    )


@dataclass
class LossArgs:
    loss_type: str = opt(
        "sigmoid", "DPOLoss's form: sigmoid (DPO), hinge (SLiC) or ipo", choices=("sigmoid", "hinge", "ipo")
    )
    beta: float = opt(0.1, "preference/KL strength: DPO's beta, GRPO's KL coefficient", check=AT_LEAST_0)
    sft_weight: float = opt(
        0.0, "DPO: weight of the chosen replies' cross-entropy added to the loss", check=AT_LEAST_0
    )
    label_smoothing: float = opt(
        0.0,
        "DPO: the share of pairs taken as mislabelled (conservative DPO)",
        check=(lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    )
    epsilon: float = opt(
        0.2, "GRPO: the ratio's clip range below 1 (and above 1 without --epsilon-high)", check=POSITIVE
    )
    epsilon_high: float | None = opt(
        None, "GRPO: the ratio's clip range above 1; None = --epsilon", check=POSITIVE
    )


# Group name -> dataclass; the order is the order of ``--help``.
GROUPS: dict[str, type] = {
    "infra": InfraArgs,
    "dataset": DatasetArgs,
    "template": TemplateArgs,
    "model": ModelArgs,
    "training": TrainingArgs,
    "lora": LoraArgs,
    "optimizer": OptimizerArgs,
    "scheduler": SchedulerArgs,
    "loss": LossArgs,
    "sampling": SamplingArgs,
    "rl": RLArgs,
    "checkpoint": CheckpointArgs,
    "sampler": SamplerArgs,
}


def _field_owners() -> dict[str, str]:
    owners: dict[str, str] = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owners, f"field {f.name!r} is in both {owners[f.name]!r} and {group!r}"
            assert f.name not in GROUPS and f.name != "extra", f"field {f.name!r} shadows a group name"
            owners[f.name] = group
    return owners


# Field name -> group name. Built (and checked for duplicates) at import time.
FIELD_GROUP: dict[str, str] = _field_owners()

# ``get_<group>_args()`` follows upstream's grouping: a field upstream keeps in another group than
# ours is listed here (field -> upstream group); every other field is in its own group.
# ``skip_bad_rows`` is a ``Dataset`` setting, not a ``DatasetMeta`` keyword: it stays out of
# get_dataset_args(), whose dict is passed as ``DatasetMeta(**...)``.
UPSTREAM_GROUP: dict[str, str] = {"seed": "training", "skip_bad_rows": "training"}
# Upstream groups no field of ours belongs to: their helper raises instead of returning an empty
# dict, which a ``**kwargs`` call would accept without a word. Name -> what to use instead.
UNSUPPORTED_GROUPS: dict[str, str] = {
    "server": "the server takes its own flags (twinkle server --help)",
}


@dataclass
class Args:
    """Everything a training script reads: thirteen typed groups plus free-form ``extra``, and
    upstream's ``get_<group>_args()`` dicts (grouped as upstream groups them).

    ``extra`` holds unknown flags and config keys (for example ``model_name`` and
    ``model_author``, which the cookbook passes to ``SelfCognitionProcessor``) so that a
    script can add its own knobs without touching this package.
    """

    infra: InfraArgs = field(default_factory=InfraArgs)
    dataset: DatasetArgs = field(default_factory=DatasetArgs)
    template: TemplateArgs = field(default_factory=TemplateArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    sampler: SamplerArgs = field(default_factory=SamplerArgs)
    extra: dict[str, Any] = field(default_factory=dict)
    # ``--resume-from-checkpoint`` as given. ``auto``/``latest`` become the newest complete
    # checkpoint under --output-dir in ``training.resume_from_checkpoint``; a script that keeps
    # checkpoints in sub-folders (one per adapter) resolves the request itself.
    resume_request: str | None = None

    def get_lora_args(self) -> dict[str, Any]:
        """Keyword arguments for ``peft.LoraConfig``; builders take flat kwargs, not ``Args``."""
        return {
            "r": self.lora.lora_r,
            "lora_alpha": self.lora.lora_alpha,
            "lora_dropout": self.lora.lora_dropout,
            "target_modules": split_target_modules(self.lora.target_modules),
            "task_type": "CAUSAL_LM",
        }

    def _upstream_group(self, group: str) -> dict[str, Any]:
        """Our fields in upstream's group ``group``; a field left at None is left out, so that a
        ``**kwargs`` call keeps the callee's own default."""
        names = [n for n, owner in FIELD_GROUP.items() if UPSTREAM_GROUP.get(n, owner) == group]
        if not names:
            raise UserError(f"not supported yet: get_{group}_args() ({UNSUPPORTED_GROUPS[group]})")
        values = {n: getattr(getattr(self, FIELD_GROUP[n]), n) for n in names}
        return {n: v for n, v in values.items() if v is not None}

    def get_model_args(self) -> dict[str, Any]:
        """model_id, model_cls, dtype, strategy, activation_checkpointing, the loss kernel switches."""
        return self._upstream_group("model")

    def get_dataset_args(self) -> dict[str, Any]:
        """dataset_id, subset_name, split (``DatasetMeta``'s keywords)."""
        return self._upstream_group("dataset")

    def get_template_args(self) -> dict[str, Any]:
        """template_cls, max_length, truncation_strategy, and the model_id the tokenizer comes
        from: ``dataset.set_template(**args.get_template_args())``."""
        out = self._upstream_group("template")
        if self.model.model_id is not None:
            out["model_id"] = self.model.model_id
        return out

    def get_training_args(self) -> dict[str, Any]:
        """The training group plus ``seed`` (upstream keeps the seed there)."""
        return self._upstream_group("training")

    def get_optimizer_args(self) -> dict[str, Any]:
        """optimizer_cls, lr (upstream's key for learning_rate) and max_grad_norm."""
        out = self._upstream_group("optimizer")
        out["lr"] = out.pop("learning_rate")
        return out

    def get_scheduler_args(self) -> dict[str, Any]:
        """scheduler_cls and num_warmup_steps (``model.set_lr_scheduler``'s keywords)."""
        return self._upstream_group("scheduler")

    def get_infra_args(self) -> dict[str, Any]:
        """Mesh sizes, mode, timeouts and Ray placement (the seed is in get_training_args())."""
        return self._upstream_group("infra")

    def get_loss_args(self) -> dict[str, Any]:
        """loss_type, beta, sft_weight, label_smoothing, epsilon (and epsilon_high when set)."""
        return self._upstream_group("loss")

    def get_checkpoint_args(self) -> dict[str, Any]:
        """save_optimizer, merge_and_sync and lora_sync_dir (when set)."""
        return self._upstream_group("checkpoint")

    def get_sampler_args(self) -> dict[str, Any]:
        """The sampler's class and vLLM engine settings (those set)."""
        return self._upstream_group("sampler")

    def get_sampling_args(self) -> dict[str, Any]:
        """max_tokens (when set), temperature, top_p, top_k: ``SamplingParams(**...)``."""
        return self._upstream_group("sampling")

    def get_server_args(self) -> dict[str, Any]:
        """Raises: the server takes its own flags."""
        return self._upstream_group("server")

    def get_rl_args(self) -> dict[str, Any]:
        """num_generations, the advantage and reward choices, GKD and routing-replay settings."""
        return self._upstream_group("rl")

    def get(self, name: str, default: Any = None) -> Any:
        """A field by its name, whatever its group (``args.get("batch_size")``), else an ``extra``
        key, else ``default`` (upstream's flat access)."""
        for group in GROUPS:
            values = getattr(self, group)
            if name in {f.name for f in dataclasses.fields(values)}:
                return getattr(values, name)
        return self.extra.get(name, default)

    def __getitem__(self, name: str) -> Any:
        """``args["batch_size"]``: like ``get``, but an unknown name raises ``KeyError``."""
        sentinel = object()
        value = self.get(name, sentinel)
        if value is sentinel:
            raise KeyError(f"{name!r} is neither a field nor an extra key of these arguments")
        return value

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (groups and ``extra``), e.g. to log or save next to a checkpoint."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in GROUPS}
        out["extra"] = dict(self.extra)
        return out


def split_target_modules(value: str) -> str | list[str]:
    """'all-linear' stays a string (PEFT's own shortcut); anything else is a list of names."""
    if value.strip() == "all-linear":
        return "all-linear"
    return [name.strip() for name in value.split(",") if name.strip()]
