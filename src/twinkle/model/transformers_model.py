"""``TransformersModel``: a Hugging Face causal LM with LoRA adapters and an explicit step API;
a model given no adapter trains every weight (``twinkle.model.full_parameter``).

The script drives the loop; this class holds the pieces and keeps the step semantics:
gradients are summed over the micro-batches of an accumulation window and divided by the
window's supervised-token count over all ranks right before the optimizer step, so the update
is the mean over every supervised token of the global batch, whatever the padding or sharding."""

import math
import re
from typing import Any

import torch

from twinkle.distributed.fsdp import apply_fsdp2
from twinkle.distributed.mesh import refuse_unimplemented
from twinkle.kernel import cpu_gemm as gemm
from twinkle.loss import as_loss, build_loss, resolve_loss
from twinkle.metric import report
from twinkle.model.activation_checkpointing import LayerCheckpointing
from twinkle.model.adapters import Adapters, PeftAdapters
from twinkle.model.attention_choice import resolve_attn_implementation
from twinkle.model.checkpoints import Checkpoints
from twinkle.model.embedding import TASK as EMBEDDING_TASK
from twinkle.model.embedding import embedding_batch, embedding_loss
from twinkle.model.expert_parallel import check_folder as check_ep_folder
from twinkle.model.expert_parallel import install as install_ep
from twinkle.model.expert_parallel import resolve_options as resolve_ep_options
from twinkle.model.forward import batch_on_device, causal_lm_of, loss_and_view, task_loss
from twinkle.model.full_parameter import FULL, full_parameter_group
from twinkle.model.inputs import InputsAPI, prepare_inputs
from twinkle.model.loading import load_causal_lm, resolve_dtype
from twinkle.model.lora import all_linear_alone
from twinkle.model.loss_inputs import keyword_inputs, split_rows, with_loss_inputs
from twinkle.model.metrics_api import MetricsAPI, record_metric_batch
from twinkle.model.optim_setup import attach_scheduler, optimizer_builder
from twinkle.model.optimizer_step import OptimizerStepAPI
from twinkle.model.options import resolve_precision, resolve_strategy
from twinkle.model.outputs import StepOutputs, joined_logps, reads_logps, step_logps
from twinkle.model.parallel_sizes import refuse_cli_sizes
from twinkle.model.router_aux import RouterAux, aux_entry, capturing, trained_loss, with_aux
from twinkle.model.router_replay import RouterReplay, refuse_dense_folder, take_action
from twinkle.model.train_state import OptimizerGroup
from twinkle.model.ulysses import check_folder as check_ulysses_folder
from twinkle.model.ulysses import counted as counted_rows
from twinkle.model.ulysses import install as install_ulysses
from twinkle.model.vision import (
    check_reads_images,
    language_model_lora,
    plain_vision_weights,
    run_tower_on_every_rank,
    sharded_layers,
)
from twinkle.runtime import get_runtime, preemption
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger
from twinkle.utils.modules import set_training

logger = get_logger()


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class TransformersModel(InputsAPI, MetricsAPI, OptimizerStepAPI, Checkpoints):
    """The model, its adapters and their training pieces; the methods come in groups: set-up and
    the training step here, raw inputs in ``twinkle.model.inputs``, evaluation and metrics in
    ``twinkle.model.metrics_api``, checkpoints in ``twinkle.model.checkpoints``. Where an adapter's
    weights live is ``adapters``' business (``twinkle.model.adapters``): plain PEFT adapters here,
    slots in ``MultiLoraTransformersModel``. The groups share the model's attributes and
    ``_group`` (an adapter's ``OptimizerGroup`` by name), and call no other private method of one
    another: what they share is ``adapters``, public methods and module functions."""

    full_parameter_training = True  # no adapter: every weight trains (twinkle.model.full_parameter)

    def __init__(
        self,
        model_id: str | None = None,
        dtype: torch.dtype | None = None,
        padding_free: bool = True,
        activation_checkpointing: str | None = None,
        *,
        model_cls: Any = None,
        config: Any = None,
        device_mesh: Any = None,
        mixed_precision: str | None = None,
        strategy: str | None = None,
        ddp_config: dict[str, Any] | None = None,
        fsdp_config: dict[str, Any] | None = None,
        grad_scaler_config: dict[str, Any] | None = None,
        attn_implementation: str | None = None,
        enable_router_replay: bool = False,
        memory_efficient_init: bool = False,
        ignore_mismatched_sizes: bool = False,
    ):
        """``dtype``: the weights' dtype; None takes the run defaults' (``--dtype``; ``auto``: bf16
        on accelerators, fp32 on CPU). ``padding_free``: run each batch packed into one row (same
        loss; see ``twinkle.model.packing``). ``activation_checkpointing``: ``auto`` (only for a
        batch whose activations would not fit), ``on`` or ``off``; None takes the run defaults'
        (``--activation-checkpointing``, else ``auto``; see
        ``twinkle.model.activation_checkpointing``).

        Upstream's keywords: ``model_cls`` (default ``AutoModelForCausalLM``), ``config`` (a
        ``PretrainedConfig`` to load ``model_id``'s weights with), ``device_mesh`` (must be the
        mesh ``initialize`` was given), ``mixed_precision`` (``no`` or ``bf16``, when ``dtype`` is
        None; ``fp16`` trains in the device's default dtype with one warning, as there is no
        gradient scaler), ``attn_implementation`` (``twinkle.model.attention_choice``: flash attention where
        the device supports it, else sdpa with a warning), ``strategy`` (None takes the run defaults', ``--strategy``; ``native_fsdp`` and
        ``accelerate`` are FSDP2; ``ddp`` keeps a whole model per rank and needs
        ``--fsdp-size 1``), ``ddp_config``, ``fsdp_config`` (``twinkle.model.options``),
        ``enable_router_replay`` (MoE routing replay: a step's ``router_replay_action`` records
        or replays each token's experts, ``twinkle.model.router_replay``; a model without
        routers is refused), ``memory_efficient_init`` (upstream loads
        the weights on one rank and broadcasts them; here every rank loads them, the same weights:
        True says so once), ``ignore_mismatched_sizes`` (``from_pretrained``'s: weights of another
        shape than the config's are initialised anew instead of refused)."""
        mesh = device_mesh or get_runtime().mesh
        refuse_unimplemented(mesh, type(self).__name__, runs=("ulysses", "ep"))  # tp/pp/...: one line
        expert_parallel = resolve_ep_options(fsdp_config, mesh.ep_size)  # twinkle.model.expert_parallel
        if enable_router_replay:
            refuse_dense_folder(model_id)  # replay on a dense model: one line before loading
        runtime = get_runtime()
        # --tp-size 2 (or a --ulysses-size) the mesh left out
        sizes = {"ulysses_size": mesh.ulysses_size, "ep_size": mesh.ep_size}
        refuse_cli_sizes(runtime.defaults.run_args, type(self).__name__, sizes)
        # heads, families, routing replay: before loading
        check_ulysses_folder(model_id, config, mesh.ulysses_size)
        ep_size = mesh.ep_size if expert_parallel else 1
        check_ep_folder(model_id, config, ep_size)
        defaults = runtime.defaults
        if strategy is None and not ddp_config:
            strategy = defaults.strategy
        self.strategy = resolve_strategy(strategy, ddp_config, fsdp_config)
        if device_mesh is not None and device_mesh != runtime.mesh:
            raise UserError(
                f"device_mesh= ({device_mesh.describe()}) is not the mesh initialize() set up "
                f"({runtime.mesh.describe()}); pass the same mesh to twinkle.initialize(global_device_mesh=...)"
            )
        dtype = dtype or resolve_precision(mixed_precision, grad_scaler_config)
        self.padding_free = padding_free
        if activation_checkpointing is None:
            activation_checkpointing = defaults.activation_checkpointing
        if dtype is None:
            dtype = resolve_dtype(defaults.dtype, runtime.device)
        gemm.bound_onednn_caches()  # before any oneDNN kernel is built (see twinkle.kernel.cpu_gemm)
        self.runtime = runtime
        self.device = runtime.device
        self.model_id = model_id
        attn = resolve_attn_implementation(attn_implementation, self.device, dtype)  # upstream's keyword
        if memory_efficient_init:
            logger.warning(
                "memory_efficient_init=True: every rank loads the weights here (the same weights; "
                "upstream loads them on one rank and broadcasts them)"
            )
        self.model, self.tokenizer, self.model_path = load_causal_lm(
            model_id,
            self.device,
            dtype,
            model_cls=model_cls or defaults.model_cls,
            config=config,
            attn=attn,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
        )
        # ulysses_size > 1: each rank runs a share of the positions (twinkle.model.ulysses)
        self.ulysses = install_ulysses(causal_lm_of(self.model), runtime.mesh, runtime.rank)
        # the routers hooked for routing replay (twinkle.model.router_replay); a dense model: one line
        self.router_replay = RouterReplay.install(self.model) if enable_router_replay else None
        # output_router_logits=True: the load-balancing loss joins the step (twinkle.model.router_aux)
        self.router_aux = RouterAux.install(causal_lm_of(self.model))
        self.checkpointing = LayerCheckpointing(self.model, activation_checkpointing)
        # ep_size > 1: this rank's blocks of experts, tokens exchanged (twinkle.model.expert_parallel)
        self.expert_parallel = (
            install_ep(causal_lm_of(self.model), runtime.mesh, runtime.rank, self.device, self.checkpointing)
            if expert_parallel
            else None
        )
        self.optimizer_group: dict[str, OptimizerGroup] = {}
        self.adapters: Adapters = PeftAdapters(self.optimizer_group, runtime)
        self.template_defaults: dict[str, Any] = {}  # keywords set_template gives a template it builds
        self._pending_eval: tuple[str, Any, Any] | None = None
        self._pending_auto = False  # the pending batch is a plain evaluation (metrics_api)
        self._pending_backward: tuple[OptimizerGroup, Any, dict[str, torch.Tensor]] | None = None
        self._pending_aux: tuple[torch.Tensor, float] | None = None  # the router aux and its factor
        self._in_train_mode = False  # set by forward_backward's train(), cleared by forward_only's eval()
        self._step_logps: Any = None  # the last training forward's logps entry (``outputs.step_logps``)

    # ----------------------------------------------------------------- set-up
    def _group(self, adapter_name: str | None) -> OptimizerGroup:
        if adapter_name == FULL or (adapter_name is None and not self.optimizer_group):
            return full_parameter_group(self, self._place_adapters)  # no adapter: every weight trains
        if adapter_name is None:
            if len(self.optimizer_group) != 1:
                raise UserError(
                    f"name the adapter (adapter_name=...); adapters: {', '.join(self.optimizer_group)}"
                )
            return next(iter(self.optimizer_group.values()))
        if adapter_name not in self.optimizer_group:
            raise UserError(
                f"unknown adapter {adapter_name!r}; adapters: {', '.join(self.optimizer_group) or 'none'}"
            )
        return self.optimizer_group[adapter_name]

    def add_adapter_to_model(
        self, adapter_name: str, config: Any, gradient_accumulation_steps: int = 1
    ) -> None:
        """Attach adapter ``adapter_name`` (a ``peft.LoraConfig``) with a training state of its own
        (``OptimizerGroup``); with slots, it is lent a free one (``MultiLoraTransformersModel``)."""
        if gradient_accumulation_steps < 1:
            raise UserError(
                f"--gradient-accumulation-steps must be at least 1, got {gradient_accumulation_steps}"
            )
        if not isinstance(adapter_name, str) or re.fullmatch(r"[A-Za-z0-9_-]+", adapter_name) is None:
            # PEFT makes the name a module attribute, which cannot hold '.'
            raise UserError(f"adapter name must be letters, digits, '_' and '-', got {adapter_name!r}")
        config = language_model_lora(causal_lm_of(self.model), all_linear_alone(config))
        self.model = self.adapters.add(self.model, adapter_name, config)
        if self.adapters.place_on_add:
            self._place_adapters()
        self.optimizer_group[adapter_name] = OptimizerGroup(
            adapter_name, gradient_accumulation_steps, loss_fn=build_loss("CrossEntropyLoss", reduction="sum")
        )

    def remove_adapter(self, adapter_name: str) -> None:
        """Drop the adapter and its training state. Only adapters that come and go can be removed:
        a ``MultiLoraTransformersModel``'s, whose slot is reset (all zero) and free."""
        group = self._group(adapter_name)
        self.adapters.remove(group.adapter_name)
        if self._pending_backward is not None and self._pending_backward[0] is group:
            self._pending_backward = None
        if self._pending_eval is not None and self._pending_eval[0] == group.adapter_name:
            self._pending_eval = None
        del self.optimizer_group[group.adapter_name]

    def _place_adapters(self) -> None:
        """Once the adapters are attached: shard the model under FSDP2, or pack the frozen weights
        for CPU training in one process."""
        if self.runtime.is_distributed:
            if self.strategy == "ddp" and self.runtime.mesh.fsdp_size != 1:
                raise UserError(
                    f"strategy='ddp' keeps a whole model on every rank, but the mesh shards it "
                    f"({self.runtime.mesh.describe()}); use --fsdp-size 1 --dp-size N, or an FSDP strategy"
                )
            lm = causal_lm_of(self.model)
            own = getattr(type(lm), "_no_split_modules", None) if self.strategy == "ddp" else None
            ignored = None
            if self.expert_parallel is not None:  # this rank's experts, left out of FSDP2's units
                ignored = self.expert_parallel.split(self.model)
            apply_fsdp2(lm, self.runtime.mesh, self.device, sharded_layers(lm), own, ignored)
            run_tower_on_every_rank(lm)  # its vision blocks are units: every rank runs them
            # Every rank drew the same LoRA initialisation (one seed); from here on each rank
            # needs its own stream, or all ranks would draw the same dropout masks.
            torch.manual_seed(self.runtime.seed + 1_000_003 * self.runtime.rank)
        elif self.device.type == "cpu":
            self._pack_frozen_weights()

    def _pack_frozen_weights(self) -> None:
        """The frozen linear weights' forward products from oneDNN-packed copies (see
        ``twinkle.kernel.cpu_gemm.pack_frozen``): unsharded CPU training only, as the copies cost
        the weights' memory again. The vision tower's plain layers are left dense: no product of
        theirs reads a copy (``twinkle.model.vision.plain_vision_weights``)."""
        dense = {id(w) for w in plain_vision_weights(self.model)}
        weights = [
            m.weight
            for m in self.model.modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in dense
        ]
        packed = gemm.pack_frozen(weights)
        if packed:
            logger.info("frozen weights packed for oneDNN: %.0f MiB", packed / 2**20)

    def set_optimizer(
        self, optimizer_cls: Any, lr: float = 1e-5, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """``optimizer_cls`` is a class, a ``torch.optim`` name, or upstream's ``'default'``
        (AdamW with Megatron's keywords, ``twinkle.model.optim_setup``); ``kwargs`` reach its
        constructor. It steps the adapter's trainable weights (with slots: the rank-r parts of its
        slot; without an adapter, every weight: ``twinkle.model.full_parameter``). ``lr``
        defaults to upstream's 1e-5."""
        group = self._group(adapter_name)
        group.optimizer = self.adapters.optimizer(
            group.adapter_name, optimizer_builder(group, optimizer_cls, lr, kwargs)
        )

    def set_lr_scheduler(
        self,
        scheduler_cls: Any,
        num_warmup_steps: int = 0,
        num_training_steps: int | None = None,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """A schedule by name or class: ours (``CosineWarmupScheduler``, which needs
        ``num_training_steps``), any ``torch.optim.lr_scheduler`` class with its own arguments
        (``'CosineAnnealingLR', T_max=...``) or upstream's ``'default'`` (``lr_decay_steps=``,
        ``max_lr=``...). ``num_training_steps`` counts micro-batches (``len(dataloader)``); the
        schedule runs over the optimizer steps they make (``twinkle.model.optim_setup``)."""
        group = self._group(adapter_name)
        attach_scheduler(group, scheduler_cls, num_warmup_steps, num_training_steps, kwargs)

    def set_loss(self, loss_cls: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """``loss_cls``: a name in ``twinkle.loss.LOSSES`` or a class (built with ``kwargs``), or
        a loss instance or callable ``(inputs, outputs) -> loss`` (``twinkle.loss.base``), which is
        wrapped here, once, into a ``twinkle.loss.Loss``."""
        self._group(adapter_name).loss_fn = as_loss(resolve_loss(loss_cls, **kwargs))

    # ----------------------------------------------------------------- steps
    def forward(
        self,
        inputs: Any,
        task: str = "causal_lm",
        adapter_name: str | None = None,
        ref_outputs: Any = None,
        **loss_inputs: Any,
    ) -> dict[str, float]:
        """The training forward of one micro-batch; ``backward()`` then runs its backward.
        ``inputs``: a batch of tensors, or rows (``twinkle.model.inputs``). ``ref_outputs`` (what
        ``forward_only`` returned on the same batch) and ``loss_inputs`` (``old_logps=``,
        ``advantages=``, ...) are extra inputs the loss declares (``twinkle.model.loss_inputs``).

        Returns ``{"loss": this rank's mean loss, "num_tokens": the loss's count}`` (supervised
        tokens; pairs for a preference loss; no logits: the packed rows and the fused loss never
        build them; with the router's aux, ``aux_loss`` too: ``forward_backward``). A model in eval
        mode (after ``forward_only``) is put back in training mode."""
        group, loss_fn, inputs = self._training_inputs(inputs, task, adapter_name, ref_outputs, loss_inputs)
        return self._forward_batch(group, loss_fn, inputs)

    def _training_inputs(
        self, inputs: Any, task: str, adapter_name: str | None, ref_outputs: Any, loss_inputs: dict
    ) -> tuple[OptimizerGroup, Any, dict]:
        """The adapter's group, its loss and this rank's share of the batch with the loss's inputs."""
        group = self._group(adapter_name)
        self.adapters.activate(group.adapter_name)
        preemption.loop_started()  # a SIGTERM from here on saves at the next step boundary
        loss_fn = task_loss(group, task)
        if self.router_replay is not None:  # the step's routes: recorded, replayed or the router's
            self.router_replay.action = take_action(loss_inputs)
        extras = keyword_inputs(loss_fn, ref_outputs, loss_inputs)
        if task == EMBEDDING_TASK:  # pooled rows, never packed (twinkle.model.embedding)
            return group, loss_fn, embedding_batch(inputs, self.tokenizer.pad_token_id or 0)
        prepared = prepare_inputs(group, inputs, self.tokenizer)
        return group, loss_fn, with_loss_inputs(loss_fn, prepared, extras, required=True)

    def _forward_batch(self, group: OptimizerGroup, loss_fn: Any, inputs: dict) -> dict[str, float]:
        group.train_metrics.start_batch()
        self._pending_aux = None
        group.eval_metrics.restart_if_empty()
        batch = batch_on_device(inputs, self.device, self.tokenizer)
        # thousands of modules with LoRA: set their flags once, and again after an eval()
        if not (self._in_train_mode and self.model.training):
            set_training(self.model, True)
            self._in_train_mode = True
        # positions the layers may run: the padded batch (a packed row is never longer)
        self.checkpointing.decide(batch["input_ids"].numel(), self.device)
        if batch["labels"].dim() == 1:  # task='embedding': one group mark per row
            with capturing(self.router_aux):  # the router's aux (twinkle.model.router_aux)
                out = embedding_loss(self.model, batch, loss_fn)
            self._pending_backward, self._step_logps = (group, out, inputs), None
        else:
            with capturing(self.router_aux):
                out, view = loss_and_view(self.model, batch, loss_fn, self.padding_free)
            self._pending_backward = (group, out, inputs)
            self._step_logps = step_logps(out, view, batch, loss_fn, self.runtime.is_distributed)
        if self.router_aux is not None:
            self._pending_aux = self.router_aux.step_term(out.num_tokens, inputs["input_ids"].shape[0] > 0)
        loss_sum = float(out.loss_sum.detach())
        result = {"loss": loss_sum / max(1, out.num_tokens), "num_tokens": out.num_tokens}
        return with_aux(result, self.router_aux, self._pending_aux)

    def backward(self) -> float:
        """Backward of the last ``forward``: the gradients join the open accumulation window.
        Returns the micro-batch's mean token loss (plus ``coef * aux``: ``forward_backward``)."""
        if self._pending_backward is None:
            raise UserError("call forward(inputs=...) before backward()")
        return self._backward(counts=True)

    def _backward(self, counts: bool) -> float:
        """``backward``; ``counts=False``: a part of a split batch, which counts (a step of
        ``cur_step``, a micro-batch of the window) at its last part only."""
        group, out, inputs = self._pending_backward
        aux, self._pending_backward, self._pending_aux = self._pending_aux, None, None
        self._step_logps = None  # forward_backward took it; a plain forward's is dropped here
        self.adapters.activate(group.adapter_name)  # a recomputed forward (checkpointing) runs it
        trained, aux_loss = trained_loss(out.loss_sum, aux)  # plus the router's aux (router_aux)
        trained.backward()  # even when not finite: under FSDP every rank must run backward
        loss_sum = float(out.loss_sum.detach())
        if counts:
            group.cur_step += 1
            report.on_backward(self.runtime, group)  # progress (twinkle.metric.report)
        finite = math.isfinite(loss_sum) and math.isfinite(aux_loss or 0.0)
        rows, seen = counted_rows(self.ulysses, inputs)  # a Ulysses group's rows count once
        group.add_micro_batch(rows, out.num_tokens, finite, counts)
        if not finite:
            return loss_sum  # kept out of the metrics, whose loss would otherwise read low
        correct = float(out.num_correct)  # a count, or summed shares (GRPOLoss: clipped tokens)
        group.train_metrics.update(loss_sum, out.num_tokens, correct, seen, rows)
        record_metric_batch(group, True, inputs, out, loss_sum, correct)
        if aux_loss is None:
            return loss_sum / max(1, out.num_tokens)
        self.router_aux.record(group.adapter_name, aux_loss)  # calculate_metric's aux_loss
        return loss_sum / max(1, out.num_tokens) + self.router_aux.coef * aux_loss

    def forward_backward(
        self,
        inputs: Any,
        task: str = "causal_lm",
        adapter_name: str | None = None,
        ref_outputs: Any = None,
        micro_batch_size: int | None = None,
        **loss_inputs: Any,
    ) -> StepOutputs:
        """``forward`` then ``backward``. Returns this rank's mean loss (per token; per pair for a
        preference loss) as a float that is also upstream's outputs (``outputs["logps"]``:
        ``twinkle.model.outputs.StepOutputs``). ``ref_outputs``/``loss_inputs``: see ``forward``.
        Where the config asks for the router's load-balancing loss, the float and ``loss`` add
        ``router_aux_loss_coef * aux``, and ``outputs["aux_loss"]`` holds the aux
        (``twinkle.model.router_aux``).

        ``micro_batch_size``: run this rank's rows ``micro_batch_size`` at a time (less memory),
        their gradients summed; the call still counts as one micro-batch of the accumulation
        window, and the step equals that of the whole batch up to summation order."""
        if micro_batch_size is None:
            if ref_outputs is not None:
                loss_inputs["ref_outputs"] = ref_outputs
            out = self.forward(inputs, task=task, adapter_name=adapter_name, **loss_inputs)
            logps, ship = self._step_logps, reads_logps(self._group(adapter_name).loss_fn)
            step = StepOutputs(self.backward(), out["num_tokens"], logps, ship_logps=ship)
            return aux_entry(step, out.get("aux_loss"))
        if task == EMBEDDING_TASK:
            raise UserError(
                "micro_batch_size= with task='embedding' would split the in-batch negatives; leave it out"
            )
        group, loss_fn, inputs = self._training_inputs(inputs, task, adapter_name, ref_outputs, loss_inputs)
        check_reads_images(causal_lm_of(self.model), inputs)  # before the first part runs
        parts = split_rows(inputs, micro_batch_size, loss_fn)
        loss_sum, tokens, logps, aux_sum = 0.0, 0, [], 0.0
        for i, part in enumerate(parts):
            out = self._forward_batch(group, loss_fn, part)
            if part["input_ids"].shape[0]:  # an empty part is this rank's pad row
                logps.append(self._step_logps)
            self._backward(counts=i == len(parts) - 1)
            loss_sum, tokens = loss_sum + out["loss"] * out["num_tokens"], tokens + out["num_tokens"]
            aux_sum += out.get("aux_loss", 0.0) * out["num_tokens"]  # weighed by tokens, as the loss
        step = StepOutputs(
            loss_sum / max(1, tokens), tokens, joined_logps(logps), ship_logps=reads_logps(loss_fn)
        )
        return aux_entry(step, None if self.router_aux is None else aux_sum / max(1, tokens))
