"""``MegatronModel`` and ``MultiLoraMegatronModel`` with upstream's constructors, run on
``TransformersModel`` / ``MultiLoraTransformersModel``.

Upstream's scripts import them unconditionally and choose them by a flag, so the names must
exist. With tensor and pipeline sizes of 1 (and no context or virtual-pipeline split) Megatron
would run the same data-parallel training FSDP2 runs here, so the calls go to the Transformers
model, with one warning per process. A size above 1 needs Megatron-Core's model parallelism on
GPUs, which Twinkle does not run: one line says so. Upstream's Megatron keywords are honoured
where they describe what the Transformers model does anyway, and refused by name otherwise
(``megatron_model_args``)."""

from pathlib import Path
from typing import Any

from twinkle.model.multi_lora import MultiLoraTransformersModel
from twinkle.model.transformers_model import TransformersModel
from twinkle.runtime import get_runtime
from twinkle.runtime.remote import remote_class
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

# upstream's Megatron optimizer names: its Adam with decoupled weight decay ('default')
MEGATRON_OPTIMIZERS = ("default", "MegatronOptimizer", "Adam")
_warned: set[str] = set()


def _refuse_model_parallel(who: str, mesh: Any) -> None:
    cli = ((get_runtime().defaults.run_args or {}).get("infra")) or {}
    for name in ("tp_size", "pp_size", "cp_size", "vpp_size"):
        size = max(getattr(mesh, name, 1) or 1, cli.get(name) or 1)
        if size > 1:
            raise UserError(
                f"{who}({name}={size}) needs Megatron-Core's model parallelism on GPUs (megatron-core, "
                f"CUDA), which Twinkle does not run; use {name}=1 (the calls then run on TransformersModel "
                "with FSDP2 over the data ranks)"
            )


def megatron_model_args(
    who: str,
    device_mesh: Any,
    mixed_precision: str | None,
    ddp_config: dict[str, Any] | None,
    load_weights: bool,
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
    recompute_modules: list | None,
    variable_seq_lengths: bool,
    use_distributed_optimizer: bool,
) -> dict[str, Any]:
    """The Transformers model's keywords for upstream's Megatron ones, or one refusing line.

    ``recompute_granularity='full'`` (uniform, one layer at a time) recomputes every decoder layer:
    ``activation_checkpointing='on'``; None is ``'off'``; left out, the run's default (``auto``:
    recompute only where the activations would not fit). ``variable_seq_lengths=True`` and
    ``use_distributed_optimizer=True`` are what runs here anyway (batches at their own lengths,
    packed; FSDP2 shards the optimizer state with the weights)."""
    mesh = device_mesh or get_runtime().mesh
    _refuse_model_parallel(who, mesh)
    refusals = {
        "ddp_config": (ddp_config, "Megatron's DDP options have no counterpart under FSDP2"),
        "load_weights": (load_weights is False, "the weights are always loaded from model_id"),
        "recompute_method": (
            recompute_method not in (None, "uniform"),
            "layers are recomputed one at a time",
        ),
        "recompute_num_layers": (
            recompute_num_layers not in (None, 1),
            "layers are recomputed one at a time",
        ),
        "recompute_modules": (recompute_modules, "whole decoder layers are recomputed"),
        "variable_seq_lengths": (variable_seq_lengths is False, "batches always run at their own lengths"),
        "use_distributed_optimizer": (
            use_distributed_optimizer is False,
            "FSDP2 always shards the optimizer state",
        ),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise UserError(f"{who}: {name} is not supported here ({why}); drop it")
    if recompute_granularity not in ("full", None, "unset"):
        raise UserError(
            f"{who}: recompute_granularity={recompute_granularity!r} is not supported; use 'full' or None"
        )
    checkpointing = {"full": "on", None: "off", "unset": None}[recompute_granularity]
    if who not in _warned:
        _warned.add(who)
        get_logger().warning(
            f"{who} runs on the Transformers model here (tensor and pipeline size 1: FSDP2 over the "
            "data ranks); Megatron-Core's model parallelism is not built"
        )
    return {
        "device_mesh": device_mesh,
        "mixed_precision": mixed_precision,
        "activation_checkpointing": checkpointing,
    }


class _MegatronNames:
    """Upstream's Megatron ``set_optimizer`` names (``'Adam'`` is its default optimizer there) and
    ``save(merge_lora=)``."""

    def set_optimizer(
        self, optimizer_cls: Any, lr: float = 1e-4, adapter_name: str | None = None, **kwargs: Any
    ):
        """As ``TransformersModel.set_optimizer``; ``'default'``, ``'MegatronOptimizer'`` and
        ``'Adam'`` are upstream's Megatron optimizer (AdamW, weight decay 0.01; lr 1e-4 as
        upstream's)."""
        if isinstance(optimizer_cls, str) and optimizer_cls in MEGATRON_OPTIMIZERS:
            optimizer_cls = "default"
        return super().set_optimizer(optimizer_cls, lr=lr, adapter_name=adapter_name, **kwargs)

    def save(self, *args: Any, merge_lora: bool = False, **kwargs: Any) -> Path | None:
        """As ``TransformersModel.save`` (same arguments); ``merge_lora=True``, upstream's Megatron
        keyword, also writes the base model with the adapter merged in as a Hugging Face folder
        ``<checkpoint>-merged`` beside the checkpoint (``twinkle.export``, rank 0). The checkpoint
        itself keeps the adapter, so training can resume from it."""
        path = super().save(*args, **kwargs)
        if merge_lora and path is not None and get_runtime().rank == 0:
            from twinkle.export import export_checkpoint

            export_checkpoint(str(path), str(path.parent / f"{path.name}-merged"), overwrite=True)
        return path


@remote_class
class MegatronModel(_MegatronNames, TransformersModel):
    """Upstream's ``MegatronModel(model_id, config, ddp_config, device_mesh, mixed_precision,
    load_weights, recompute_*, variable_seq_lengths=, use_distributed_optimizer=)`` on
    ``TransformersModel`` (module docstring). ``mixed_precision`` None is the run's dtype
    (bf16 on accelerators, as upstream's default)."""

    full_parameter_training = False  # adapters only: a model without one refuses in one line

    def __init__(
        self,
        model_id: str | None = None,
        config: Any = None,
        ddp_config: dict[str, Any] | None = None,
        device_mesh: Any = None,
        mixed_precision: str | None = None,
        load_weights: bool = True,
        recompute_granularity: str | None = "unset",
        recompute_method: str | None = None,
        recompute_num_layers: int | None = None,
        recompute_modules: list | None = None,
        *,
        variable_seq_lengths: bool = True,
        use_distributed_optimizer: bool = True,
    ):
        args = megatron_model_args(
            "MegatronModel",
            device_mesh,
            mixed_precision,
            ddp_config,
            load_weights,
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            recompute_modules,
            variable_seq_lengths,
            use_distributed_optimizer,
        )
        super().__init__(model_id, config=config, **args)


@remote_class
class MultiLoraMegatronModel(_MegatronNames, MultiLoraTransformersModel):
    """Upstream's ``MultiLoraMegatronModel`` (``MegatronModel``'s keywords plus ``max_loras``,
    ``max_r``, ``max_length``, ``target_modules``) on ``MultiLoraTransformersModel``."""

    def __init__(
        self,
        model_id: str | None = None,
        config: Any = None,
        ddp_config: dict[str, Any] | None = None,
        device_mesh: Any = None,
        mixed_precision: str | None = None,
        load_weights: bool = True,
        recompute_granularity: str | None = "unset",
        recompute_method: str | None = None,
        recompute_num_layers: int | None = None,
        recompute_modules: list | None = None,
        max_loras: int = 5,
        max_r: int = 32,
        max_length: int = 8192,
        target_modules: Any = "all-linear",
        *,
        variable_seq_lengths: bool = True,
        use_distributed_optimizer: bool = True,
    ):
        args = megatron_model_args(
            "MultiLoraMegatronModel",
            device_mesh,
            mixed_precision,
            ddp_config,
            load_weights,
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            recompute_modules,
            variable_seq_lengths,
            use_distributed_optimizer,
        )
        super().__init__(
            model_id,
            max_loras=max_loras,
            max_r=max_r,
            max_length=max_length,
            target_modules=target_modules,
            config=config,
            **args,
        )
