"""``TransformersModel``'s evaluation and numbers: ``forward_only``, ``calculate_loss``,
``add_metric``, ``calculate_metric``, ``get_train_configs``.

The built-in numbers (``twinkle.metric.TokenMetrics`` and the step counters) are always
reported. Metrics from ``add_metric`` see each micro-batch whose loss is finite (training: at
``backward``; evaluation: at ``calculate_loss``), but only once the next one arrives or
``calculate_metric`` is called, so the learning rate and gradient norm they read are those of
the step that used the micro-batch. Their numbers join the built-in ones, replacing a built-in
number of the same name."""

import contextlib
import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from twinkle.loss import LossOutput
from twinkle.metric import build_metric, report
from twinkle.model import health
from twinkle.model.embedding import TASK as EMBEDDING_TASK
from twinkle.model.embedding import embed_for_eval, embedding_batch
from twinkle.model.eval_parts import forward_only_in_parts
from twinkle.model.forward import batch_on_device, causal_lm_of, loss_and_view, task_loss
from twinkle.model.full_parameter import refuse_adapters_off
from twinkle.model.inputs import prepare_inputs
from twinkle.model.lora_modes import (
    BASE_ROW,
    adapter_per_row,
    adapter_per_span,
    adapters_off,
    can_segment,
    lora_layers,
    loss_and_logps,
    token_runs,
)
from twinkle.model.loss_inputs import keyword_inputs, missing_inputs, with_loss_inputs
from twinkle.model.outputs import LogpsOnly, ModelOutputs, label_logps, metric_logps
from twinkle.model.packing import can_pack, shifted_targets
from twinkle.model.router_replay import take_action
from twinkle.model.train_state import OptimizerGroup
from twinkle.model.ulysses import counted as counted_rows
from twinkle.utils.errors import UserError
from twinkle.utils.modules import any_training, set_training


class MetricsAPI:
    """Mixed into ``TransformersModel`` (which provides ``model``, ``tokenizer``, ``device``,
    ``runtime``, ``adapters``, ``padding_free``, ``_group``); ``record_metric_batch`` is what the
    training step calls."""

    last_outputs: ModelOutputs | None = None  # what the last forward_only returned
    # (loss, inputs) the last forward_only lacked, or why it recorded nothing (``eval_parts``)
    _eval_without: tuple[str, list[str]] | str | None = None

    @torch.no_grad()
    def forward_only(
        self,
        inputs: Any,
        task: str = "causal_lm",
        adapter_name: str | None = None,
        disable_lora: bool = False,
        adapter_names: Sequence[str | None] | None = None,
        ref_outputs: Any = None,
        micro_batch_size: int | None = None,
        **loss_inputs: Any,
    ) -> ModelOutputs:
        """Evaluate one batch (no gradients, dropout off); ``calculate_loss()`` records it.
        ``inputs``: a batch of tensors, or rows (``twinkle.model.inputs``). Returns
        ``ModelOutputs`` (``twinkle.model.outputs``): ``{"loss": mean loss, "num_tokens", "logps":
        (B, L) log-probability of each label (0 where the label is -100)}``, also kept as
        ``last_outputs``; ``logps`` is what a loss takes as reference outputs (DPO).

        ``disable_lora=True``: the base model's outputs, every adapter off: a no-grad forward of
        the base layers, the head on the supervised rows only (a reference pass costs no full
        logits). ``adapter_names``: one adapter name per row (None: the base model for that row),
        all rows in one pass, each with its own adapter. Either mode runs the batch unpacked. The
        adapter whose loss, template and eval metrics serve the batch is ``adapter_name``, else
        the first named row's.

        ``ref_outputs``/``loss_inputs``: the loss's extra inputs, as for ``forward``. Without
        them a loss that declares them is not computed (a reference pass): ``loss`` is NaN and
        ``calculate_loss()`` has nothing to record; ``logps`` is there all the same.

        ``micro_batch_size``: run the rows that many at a time (``twinkle.model.eval_parts``).

        ``router_replay_action`` (a model built with ``enable_router_replay=True``):
        ``RECORD`` returns each token's experts as ``routed_experts``, ``REPLAY_FORWARD`` routes
        the tokens to the batch's ``routed_experts`` (``twinkle.model.router_replay``)."""
        if disable_lora and adapter_names is None:
            refuse_adapters_off(self.optimizer_group)  # a model that trains every weight has none
        replay = getattr(self, "router_replay", None)
        if replay is not None and micro_batch_size is None:
            replay.action = take_action(loss_inputs)
        if task == EMBEDDING_TASK:  # pooled rows (twinkle.model.embedding): a dict with embeddings
            group = self._group(adapter_name)
            loss_fn = (
                task_loss(group, task) if getattr(group.loss_fn, "consumes", None) == "embeddings" else None
            )
            self.adapters.activate(group.adapter_name)
            if any_training(self.model):
                set_training(self.model, False)
            self._in_train_mode = False
            batch = embedding_batch(inputs, self.tokenizer.pad_token_id or 0, marks=False)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with adapters_off(self.model) if disable_lora else contextlib.nullcontext():
                return embed_for_eval(self.model, batch, loss_fn)
        if micro_batch_size is not None:
            if adapter_names is not None:
                raise UserError("forward_only: pass adapter_names=[...] or micro_batch_size=, not both")
            return forward_only_in_parts(
                self, inputs, micro_batch_size, task, adapter_name, disable_lora, ref_outputs, loss_inputs
            )
        group = self._group(adapter_name if adapter_name is not None else _first_named(adapter_names))
        if not disable_lora and adapter_names is None:
            self.adapters.activate(group.adapter_name)
        loss_fn = task_loss(group, task)
        extras = keyword_inputs(loss_fn, ref_outputs, loss_inputs)
        prepared = prepare_inputs(group, inputs, self.tokenizer)
        inputs = with_loss_inputs(loss_fn, prepared, extras, required=False)
        group.eval_metrics.start_batch()
        missing = missing_inputs(loss_fn, inputs)
        if missing:  # a reference pass: its time belongs to the training step it precedes
            group.train_metrics.start_batch()
        else:  # an evaluation: it starts no training window
            group.train_metrics.restart_if_empty()
        batch = batch_on_device(inputs, self.device, self.tokenizer)
        if any_training(self.model):
            set_training(self.model, False)
        self._in_train_mode = False
        run_fn = LogpsOnly(loss_fn.name) if missing else loss_fn
        if adapter_names is not None:
            out, logps = self._mixed_pass(disable_lora, adapter_names, batch, run_fn)
        else:
            # Adapters off is the plain eval of the base model: the head on the supervised rows
            # only, packed as the policy pass of a loss that reads the reference is.
            mode = adapters_off(self.model) if disable_lora else contextlib.nullcontext()
            with mode:
                out, view = loss_and_view(self.model, batch, run_fn, self.padding_free)
            logps = label_logps(out, view, batch, lazy=not self.runtime.is_distributed)
        self._record_pending_eval()  # the batch before, as upstream records it (see calculate_loss)
        self._pending_eval = None if missing else (group.adapter_name, out, inputs)
        self._pending_auto = adapter_names is None and not disable_lora  # a plain evaluation batch
        self._eval_without = (loss_fn.name, missing) if missing else None
        mean = float(out.loss_sum) / max(1, out.num_tokens)
        routes = replay.recorded_routes() if replay is not None and replay.action is not None else None
        self.last_outputs = ModelOutputs(mean, out.num_tokens, logps, routes)
        return self.last_outputs

    def _lora_mode(self, disable_lora: bool, adapter_names: Sequence[str | None], rows: int) -> list[str]:
        """The PEFT adapter of each row (``BASE_ROW``: none), checked against the batch."""
        if disable_lora:
            raise UserError("forward_only: pass disable_lora=True or adapter_names=[...], not both")
        names = list(adapter_names)
        if len(names) != rows:
            raise UserError(
                f"adapter_names has {len(names)} name(s) for a batch of {rows} row(s); give one per row "
                "(None for the base model)"
            )
        if rows == 0:  # this rank's empty share runs one pad row (``batch_on_device``)
            names = [None]
        return [
            BASE_ROW if n is None else self.adapters.peft_name(self._group(n).adapter_name) for n in names
        ]

    def _mixed_pass(
        self, disable_lora: bool, adapter_names: Sequence[str | None], batch: dict, loss_fn: Any
    ) -> tuple[Any, torch.Tensor]:
        """``forward_only`` of a batch whose rows name their adapters: packed where the plain
        evaluation would pack (``lora_modes.adapter_per_span``), else row by row."""
        names = self._lora_mode(disable_lora, adapter_names, batch["input_ids"].shape[0])
        layers, runs = lora_layers(self.model), None
        # under Ulysses a rank holds a share of the row's tokens: the rows keep their adapters; the
        # runs are the packed row's places, so only where the forward packs (``can_pack``)
        packs = can_pack(causal_lm_of(self.model), names)
        if self.padding_free and self.ulysses is None and can_segment(layers) and packs:
            runs = token_runs(batch, names)
        if runs is None:
            with adapter_per_row(self.model, names):
                return loss_and_logps(self.model, batch, loss_fn)
        with adapter_per_span(layers, runs):
            out, view = loss_and_view(self.model, batch, loss_fn, padding_free=True, share_prefix=names)
        return out, label_logps(out, view, batch, lazy=not self.runtime.is_distributed)

    def _record_pending_eval(self) -> None:
        """Record a ``forward_only`` batch no ``calculate_loss()`` recorded, as upstream's model
        does when the next ``forward_only`` or ``calculate_metric(is_training=False)`` comes: an
        evaluation loop that never calls ``calculate_loss`` still reports its batches. A batch of
        mixed adapters or with the adapters off is recorded only when ``calculate_loss`` asks."""
        if self._pending_eval is not None and self._pending_auto:
            self.calculate_loss()

    def calculate_loss(self) -> float:
        """Record the last ``forward_only`` batch in the eval metrics; return its mean token loss.
        Each batch is recorded once: here, or by the next ``forward_only`` or
        ``calculate_metric(is_training=False)``."""
        if self._pending_eval is None:
            if isinstance(self._eval_without, str):
                raise UserError(self._eval_without)
            if self._eval_without is not None:
                name, missing = self._eval_without
                raise UserError(
                    f"the last forward_only had no {', '.join(missing)} for the loss {name}, so there is no "
                    "loss to record; pass them to forward_only too (ref_outputs=...) before calculate_loss()"
                )
            raise UserError("call forward_only(inputs=...) before calculate_loss()")
        name, out, inputs = self._pending_eval
        self._pending_eval = None
        group = self.optimizer_group[name]
        loss_sum = float(out.loss_sum)
        correct = float(out.num_correct)  # a count, or summed shares (GRPOLoss: clipped tokens)
        rows, seen = counted_rows(self.ulysses, inputs)  # a Ulysses group's rows count once
        group.eval_metrics.update(loss_sum, out.num_tokens, correct, seen, rows)
        if math.isfinite(loss_sum):
            record_metric_batch(group, False, inputs, out, loss_sum, correct)
        return loss_sum / max(1, out.num_tokens)

    def add_metric(
        self, metric_cls: Any, is_training: bool | None = None, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """Report ``metric_cls`` (a name in ``twinkle.metric.METRICS``, a ``Metric`` class built
        with the model's mesh and ``kwargs``, or an instance) from ``calculate_metric``: for
        training (``is_training=True``), evaluation (``False``) or both (None, a copy each)."""
        group = self._group(adapter_name)
        kinds = (True, False) if is_training is None else (bool(is_training),)
        for kind in kinds:
            metric = build_metric(metric_cls, device_mesh=self.runtime.mesh, process_group=None, **kwargs)
            if metric is metric_cls and kind is False and len(kinds) == 2:
                metric = copy.deepcopy(metric)  # an instance must not count both kinds of batch
            group.added_metrics[kind].append(metric)

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Numbers since the last call, reduced over all ranks: loss, accuracy, tokens/s, and for
        training also grad_norm, lr, step counters (and the router's ``aux_loss`` where the config
        asks for it, ``twinkle.model.router_aux``); then those of the added metrics. An eval
        whose loss is NaN/inf (or undefined: no supervised token) raises ``UserError`` once it is
        recorded (``twinkle.model.health``)."""
        group = self._group(adapter_name)
        if not is_training:
            self._record_pending_eval()
            metrics = group.eval_metrics.compute()
        else:
            metrics = group.train_metrics.compute()
            metrics.update(
                grad_norm=group.last_grad_norm,
                lr=group.last_lr,
                step=group.cur_step,
                optimizer_steps=group.optimizer_steps,
                skipped_steps=group.skipped_steps,
                nonfinite_steps=group.nonfinite_steps,
            )
            aux = getattr(self, "router_aux", None)  # the router's load-balancing loss (router_aux)
            if aux is not None:
                metrics.update(aux.metrics(group.adapter_name))
        name = getattr(group.loss_fn, "correct_metric", "accuracy")  # what the loss's num_correct counts
        if name != "accuracy" and "accuracy" in metrics:
            metrics[name] = metrics.pop("accuracy")
        count = health.count_metric(group.loss_fn)  # what the loss's num_tokens counts (pairs, completions)
        if count != "supervised_tokens" and "supervised_tokens" in metrics:
            metrics[count] = metrics.pop("supervised_tokens")
        flush_metric_batch(group, is_training)
        for metric in group.added_metrics[is_training]:
            metrics.update(metric.calculate())
        report.on_metrics(self.runtime, group, metrics, is_training)  # metrics.jsonl, --report-to
        if not is_training:
            health.check_eval(group, metrics)  # a NaN/inf eval loss stops the run (the record keeps it)
        return metrics

    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """One line: the model, the adapter, its trainable weights, optimizer, schedule, loss."""
        group = self._group(adapter_name)
        n_train = self.adapters.trainable_count(group.adapter_name)
        n_all = sum(p.numel() for p in self.model.parameters())
        sched = type(group.lr_scheduler).__name__ if group.lr_scheduler is not None else None
        loss = getattr(group.loss_fn, "__name__", type(group.loss_fn).__name__)  # a function by its name
        return (
            f"model={self.model_path} device={self.device} dtype={next(self.model.parameters()).dtype} "
            f"adapter={group.adapter_name} trainable={n_train:,}/{n_all:,} ({100 * n_train / max(1, n_all):.2f}%) "
            f"optimizer={type(group.optimizer.optimizer).__name__} scheduler={sched} loss={loss} "
            f"gradient_accumulation_steps={group.gradient_accumulation_steps}{self.adapters.describe()}"
        )


def _first_named(adapter_names: Sequence[str | None] | None) -> str | None:
    return next((n for n in adapter_names or () if n is not None), None)


def record_metric_batch(
    group: OptimizerGroup,
    is_training: bool,
    inputs: Any,
    out: LossOutput,
    loss_sum: float,
    correct: int,
) -> None:
    """Keep the micro-batch for the added metrics of ``group`` (``is_training``: which kind); the
    one kept before is accumulated now that its step is known."""
    if not group.added_metrics[is_training]:
        return
    flush_metric_batch(group, is_training)
    embeddings = getattr(out, "embeddings", None)
    if embeddings is not None:  # task='embedding': the pooled rows and their group marks
        outputs = {
            "loss": loss_sum,
            "num_tokens": out.num_tokens,
            "num_correct": correct,
            "embeddings": embeddings,
        }
        group.pending_metric_batch[is_training] = (dict(inputs), outputs)
        return
    shifted = {**inputs, "labels": shifted_targets(inputs["labels"], inputs["attention_mask"])}
    outputs = {"loss": loss_sum, "num_tokens": out.num_tokens, "num_correct": correct, "logits": None}
    outputs.update(metric_logps(out, inputs, shifted["labels"]))
    group.pending_metric_batch[is_training] = (shifted, outputs)


def flush_metric_batch(group: OptimizerGroup, is_training: bool) -> None:
    """The kept micro-batch into the added metrics, with its step's numbers."""
    pending = group.pending_metric_batch.pop(is_training, None)
    if pending is None:
        return
    lr = group.last_lr
    if not math.isfinite(lr):
        lr = group.optimizer.param_groups[0]["lr"] if group.optimizer is not None else None
    context = {
        "lr": lr,
        "step": group.cur_step,
        "gradient_accumulation_steps": group.gradient_accumulation_steps,
        "grad_norm": group.last_grad_norm if math.isfinite(group.last_grad_norm) else None,
        "loss_reduction": "sum",
    }
    for metric in group.added_metrics[is_training]:
        metric.accumulate(*pending, **context)
