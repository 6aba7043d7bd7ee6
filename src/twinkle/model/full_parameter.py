"""Full-parameter training: a ``TransformersModel`` given no adapter trains every base weight.

The training pieces live on an ``OptimizerGroup`` per adapter; a model whose script never adds
an adapter (upstream's ``dpo_full.py``: ``set_optimizer``, ``set_loss``, ``forward_backward``
straight on the model) gets one implicit group, named ``FULL`` (upstream's default adapter name,
``''``), at its first such call. From then on every weight has ``requires_grad`` and the model's
``adapters`` is a ``FullParameterAdapters``: the optimizer steps all weights, a checkpoint holds
the whole model as Hugging Face files (``config.json``, ``model.safetensors``, the tokenizer)
that ``AutoModelForCausalLM.from_pretrained`` loads, and a resume puts the weights back. A model
trains either every weight or LoRA adapters, never both: adding an adapter after the implicit
group exists, or naming the implicit group once an adapter exists, is refused in one line. Its
accumulation window is set per call (``clip_grad_and_step(gradient_accumulation_steps=)``, as
upstream's scripts do), and a resume takes the checkpoint's. A DPO reference is a second model
without an adapter (its ``forward_only``): ``disable_lora=True`` has nothing to turn off here.

Under FSDP2 the weights are sharded once, when the group is made, and the optimizer steps each
rank's shards, its state sharded alike (``twinkle.model.sharded_optimizer``). A save gathers the
full state dict on rank 0 only (``torch.distributed.checkpoint``'s ``get_model_state_dict``) and
the optimizer state at full size, so a checkpoint is the same whatever the mesh's shape. Under
expert parallelism (``ep_size > 1``) each rank also trains its own block of every MoE layer's
experts, which FSDP2 leaves out (``twinkle.model.expert_parallel_full``): the checkpoint gathers
every expert, and a resume keeps each rank's block.

A family whose Hugging Face files hold its weights in another layout than its modules (MoE
experts: one matrix per expert on disk, fused 3-D weights in the model) is resumed through its
class's ``from_pretrained``, which knows the conversion."""

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from twinkle.checkpoint import integrity, layout
from twinkle.loss import build_loss
from twinkle.model.adapters import Adapters, Build, PeftAdapters
from twinkle.model.expert_parallel_full import ExpertBlocks, ExpertShardedOptimizer
from twinkle.model.sharded_optimizer import ShardedOptimizer
from twinkle.model.step import restore_grad
from twinkle.model.train_state import OptimizerGroup
from twinkle.optim.replicated import ReplicatedOptimizer
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()

FULL = ""  # the implicit group's name, upstream's default adapter name (no LoRA name can be empty)


def full_parameter_group(model: Any, place: Callable[[], None]) -> OptimizerGroup:
    """The implicit group of ``model`` (a ``TransformersModel``), made at the first call that
    needs it: every weight set trainable, then ``place`` (the model's placement: FSDP2 when
    distributed) run once. Refused for a model with LoRA adapters, and for model classes that
    train adapters only (``full_parameter_training`` False)."""
    groups = model.optimizer_group
    if FULL in groups:
        return groups[FULL]
    name = type(model).__name__
    if groups:
        raise UserError(
            f"{name} trains the LoRA adapter(s) {', '.join(groups)}, so it cannot also train every weight "
            "(adapter_name=''); build another model without add_adapter_to_model for full-parameter training"
        )
    if not getattr(model, "full_parameter_training", False) or type(model.adapters) is not PeftAdapters:
        raise UserError(
            f"{name} has no adapter: full-parameter training is not supported yet, and the loss, processor "
            "and optimizer live on an adapter; add a LoRA adapter first (add_adapter_to_model)"
        )
    for p in model.model.parameters():
        p.requires_grad_(True)
    adapters = FullParameterAdapters(groups, model.runtime, model)
    model.adapters = adapters
    place()
    ep = getattr(model, "expert_parallel", None)
    if ep is not None:  # each rank trains its block of the experts (twinkle.model.expert_parallel_full)
        adapters.experts = ExpertBlocks(ep, model.model, model.runtime.mesh, model.runtime.rank)
    groups[FULL] = OptimizerGroup(FULL, 1, loss_fn=build_loss("CrossEntropyLoss", reduction="sum"))
    logger.info(f"{name}: no adapter, so every weight trains (full-parameter)")
    return groups[FULL]


def refuse_adapters_off(groups: dict[str, Any]) -> None:
    """``forward_only(disable_lora=True)`` on a model without a LoRA adapter: nothing to turn
    off, so the outputs would be the trained weights', not a reference's; one line."""
    if not groups or FULL in groups:
        raise UserError(
            "forward_only(disable_lora=True): this model has no LoRA adapter to turn off (it trains every "
            "weight), so its outputs would be the trained weights', not the base model's; take the reference "
            "from a second model without an adapter (its forward_only)"
        )


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FullParameterAdapters(Adapters):
    """The ``Adapters`` of a full-parameter model: one implicit adapter (``FULL``) whose weights
    are all of the model's. ``model`` is the ``TransformersModel`` (its ``model`` attribute, the
    Hugging Face causal LM, is read at each call)."""

    place_on_add = False

    def __init__(self, groups: dict[str, Any], runtime: Any, owner: Any):
        super().__init__(groups, runtime)
        self.owner = owner
        self.experts: ExpertBlocks | None = None  # this rank's expert blocks under expert parallelism

    @property
    def lm(self) -> Any:
        return self.owner.model

    def add(self, model: Any, name: str, config: Any) -> Any:
        raise UserError(
            f"add_adapter_to_model({name!r}): this model already trains every weight (set_optimizer, "
            "set_loss or a step ran without an adapter), so a LoRA adapter cannot be added; build another "
            "model and add the adapter before any other call"
        )

    def remove(self, name: str) -> None:
        raise UserError("remove_adapter: a full-parameter model has no adapter to remove")

    def activate(self, name: str) -> None:
        pass

    def peft_name(self, name: str) -> str:
        raise UserError(
            "adapter_names=[...]: a full-parameter model has no adapters to choose per row; leave it out"
        )

    def lora_config(self, name: str) -> None:
        return None  # no LoRA: the checkpoint records ``lora: null``

    def optimizer(self, name: str, build: Build) -> ReplicatedOptimizer:
        """``build`` over every weight; the vectors (biases, norm scales) then form a second
        parameter group without weight decay, as Hugging Face's trainer and upstream do."""
        params = list(self.lm.parameters())
        vectors = [p.dim() < 2 for p in params]
        grouped = lambda copies: without_decay(build(copies), copies, vectors)  # noqa: E731
        if self.experts is not None:  # and its own expert blocks
            return ExpertShardedOptimizer(params, grouped, self.runtime.rank, self.experts)
        if any(hasattr(p, "full_tensor") for p in params):  # sharded: each rank steps its shards
            return ShardedOptimizer(params, grouped, self.runtime.rank)
        return ReplicatedOptimizer(params, grouped)

    def trainable_count(self, name: str) -> int:
        if self.experts is None:
            return sum(p.numel() for p in self.lm.parameters())
        own = sum(p.numel() for p in self.lm.parameters() if not self.experts.holds(p))
        return own + self.experts.count()

    def describe(self) -> str:
        return " full_parameter=True"

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Every weight, full size on the CPU, under the model's own names (a collective under
        FSDP: each rank gathers the whole model)."""
        state = {k: _full_tensor(v).detach().to("cpu") for k, v in self.lm.state_dict().items()}
        if self.experts is not None:
            for k, block in self.experts.named.items():
                state[k] = self.experts.all_gather(block)
        return state

    def export(self, name: str) -> tuple[dict, Any]:
        """The full state dict, gathered on rank 0 (empty elsewhere: only rank 0 writes it), and
        the writer of the Hugging Face files, which ``save_checkpoint`` calls on rank 0 where it
        writes a LoRA checkpoint's adapter config."""
        optimizer = self.groups[FULL].optimizer if FULL in self.groups else None
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.gather_state()  # a collective: rank 0 writes it at full size
        if self.runtime.is_distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.lm, options=options)
            # a tied weight's second name holds a gathered copy, which save_pretrained (deduplicating
            # by storage) would write again: dropped, so the files are one process's
            for alias in _tied_aliases(self.lm):
                state.pop(alias, None)
        else:
            state = self.lm.state_dict()
        if self.experts is not None:  # every expert, gathered from the blocks on rank 0
            state = self.experts.gather_state_dict(state)
        return {}, HFModelFiles(self.lm, state)

    def window_params(self, name: str) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.lm.named_parameters()

    def restore_window_grads(self, name: str, grads: dict[str, torch.Tensor]) -> None:
        params = dict(self.lm.named_parameters())
        for n, g in grads.items():
            restore_grad(params[n], g)

    def load_weights(self, folder: Path, name: str) -> None:
        """Every weight from the ``*.safetensors`` files of ``folder`` (verified against its
        marker); each rank copies its own shard (or expert block) of the full tensors, without
        communication."""
        from safetensors.torch import load_file

        files = sorted(f.name for f in Path(folder).glob("*.safetensors") if f.name != layout.ADAPTER_WEIGHTS)
        if not files:
            raise UserError(
                f"{folder} holds no model weights (*.safetensors); resume a full-parameter model from a "
                "checkpoint its save wrote"
            )
        integrity.verify(folder, files)
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(Path(folder) / file, device="cpu"))
        params = dict(self.lm.named_parameters())
        missing = [n for n in params if n not in tensors]
        if missing:  # the files' layout is not the modules' (fused experts): from_pretrained's own reading
            tensors = _as_loaded(self.lm, folder)
            missing = [n for n in params if n not in tensors]
        if missing:
            raise UserError(
                f"checkpoint {folder} lacks {len(missing)} weight(s) of this model (e.g. {missing[0]}); "
                "resume with the model it was saved from"
            )
        with torch.no_grad():
            for n, p in params.items():
                full = tensors[n].to(p.dtype)
                if self.experts is not None and self.experts.holds(p):
                    full = self.experts.slice(full)
                if tuple(full.shape) != tuple(p.shape):
                    raise UserError(
                        f"checkpoint {folder} holds {n} of shape {tuple(full.shape)}, this model's is "
                        f"{tuple(p.shape)}; resume with the model it was saved from"
                    )
                if hasattr(p, "to_local"):
                    from torch.distributed.tensor import distribute_tensor

                    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(local.to_local())
                else:
                    p.copy_(full)


def _tied_aliases(lm: torch.nn.Module) -> list[str]:
    """The names under which ``lm`` registers a weight it registered earlier under another name
    (tied weights: a tied head's ``lm_head.weight``)."""
    seen: set[int] = set()
    aliases = []
    for name, p in lm.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.append(name)
        seen.add(id(p))
    return aliases


def _as_loaded(lm: Any, folder: Path) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face ``folder`` under ``lm``'s own names and shapes, read by
    ``lm``'s class's ``from_pretrained`` on the CPU. ``save_pretrained`` writes some families'
    weights in another layout than their modules hold (MoE experts: one matrix per expert on
    disk, fused 3-D ``gate_up_proj``/``down_proj`` in the model), and only transformers' loading
    knows each family's conversion; it costs one more copy of the model while it runs."""
    dtype = next(lm.parameters()).dtype
    loaded = type(lm).from_pretrained(str(folder), config=lm.config, dtype=dtype)
    return {n: t.detach() for n, t in loaded.state_dict().items()}


def without_decay(optimizer: Any, params: list[torch.Tensor], exempt: list[bool]) -> Any:
    """``optimizer`` (one parameter group over ``params``) with the ``exempt`` ones moved to a
    group of their own whose ``weight_decay`` is 0; unchanged when it has no weight decay."""
    if len(optimizer.param_groups) != 1 or not optimizer.param_groups[0].get("weight_decay"):
        return optimizer
    decayed = [p for p, e in zip(params, exempt, strict=True) if not e]
    if not decayed or len(decayed) == len(params):
        return optimizer
    optimizer.param_groups[0]["params"] = decayed
    optimizer.add_param_group(
        {"params": [p for p, e in zip(params, exempt, strict=True) if e], "weight_decay": 0.0}
    )
    return optimizer


class HFModelFiles:
    """Writes a full-parameter checkpoint's model files with the model's own ``save_pretrained``
    (config, generation config, safetensors; tied weights once), from the gathered ``state``.
    ``save_checkpoint`` writes a LoRA checkpoint's (empty, here) adapter weights before it calls
    this; they are removed, so the folder is a plain Hugging Face model folder."""

    def __init__(self, lm: Any, state: dict[str, torch.Tensor]):
        self.lm, self.state = lm, state

    def save_pretrained(self, folder: str | Path) -> None:
        (Path(folder) / layout.ADAPTER_WEIGHTS).unlink(missing_ok=True)
        self.lm.save_pretrained(str(folder), state_dict=self.state, safe_serialization=True)
