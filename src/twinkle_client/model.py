"""``MultiLoraTransformersModel`` over a ``twinkle server``: the local class's training calls in
upstream's client shapes, each adapter a Tinker training run on the server.

Inputs are encoded rows (``{"input_ids", "labels"}``, labels aligned with the inputs, -100
where a token is not trained) or a padded batch of tensors; they travel as shifted Tinker
datums (``twinkle_client.batches``); a row's images go as its processed images in the datum's
``loss_fn_inputs`` (Qwen-VL), or for a Gemma 3 / Gemma 4 base, whose rows carry no grid sizes
the server could check them by, as ``ImageChunk``s in place of their soft tokens
(``twinkle_client.image_prompts.training_input``). The step is the local one:

- cross entropy (the default, or ``set_loss('CrossEntropyLoss')``) is the server's
  ``cross_entropy`` asking for the local gradient, the mean over the window's trained tokens
  (``loss_fn_config={"twinkle_reduction": "token_mean"}``);
- any other loss by name (``DPOLoss``, ``GRPOLoss``, ``GSPOLoss``, ...; ``twinkle.loss.LOSSES``)
  with its arguments is computed by the server from the targets' log-probabilities
  (``twinkle.server.objectives``), with the step's values the loss reads: ``ref_outputs`` (or
  ``ref_logps``), ``old_logps``, ``advantages``. A value the loss does not read, or one it needs
  that is missing, is a ``ValueError`` naming it;
- ``GKDLoss`` (``forward_backward(inputs, teacher_topk_logprobs=, teacher_topk_indices=)``) and
  ``task='embedding'`` with ``InfonceLoss`` (``forward_backward`` and ``forward_only``, which
  return the rows' ``embeddings``) run the model's own step on the server
  (``twinkle.server.model_steps``; the datums: ``twinkle_client.tasks``);
- ``gradient_accumulation_steps=N`` (``add_adapter_to_model`` or ``clip_grad_and_step``): the
  optimizer steps after exactly N ``forward_backward`` calls, the window's gradient averaged
  over all of them, as the local window is;
- metrics added by name (``add_metric('DPOMetric', beta=0.1)``, the GRPO family, ``TrainMetric``,
  ``EmbeddingMetric``) are the local classes, fed here with what the local model feeds them:
  each micro-batch's shifted labels and per-label log-probs (the server returns them), or its
  row marks and embeddings, the step's values, and the optimizer step's learning rate and
  gradient norm."""

import os
from typing import Any

import torch

from twinkle.server.common import local_model_id, serves
from twinkle_client import batches, image_prompts, tasks
from twinkle_client.adapter import Adapter, warn_unapplied, window_steps
from twinkle_client.connection import Connection, current_client
from twinkle_client.optim import AdamSettings
from twinkle_client.responses import Response, SaveResponse, StepResult, TrainConfigs
from twinkle_client.tinker_patch import as_tinker_path

TOKEN_MEAN = {"twinkle_reduction": "token_mean"}
STEP_VALUES = {"ref_logps": "ref_logps", "old_logps": "logprobs", "advantages": "advantages"}
LOCAL_NAMES = {wire: name for name, wire in STEP_VALUES.items()}
PROCESSORS = {"InputProcessor": ("padding_side", "padding_free")}
# metrics that need what the server does not return (the logits' argmax) or that the model
# never sees (rewards): refused by name rather than reported empty
NO_METRIC = {
    "Accuracy": "it counts the logits' argmax, which the server does not return",
    "CompletionRewardMetric": "its rewards never reach the model; call its accumulate(...) yourself",
}


class MultiLoraTransformersModel:
    """Adapters trained on the server's base model (``model_id`` None: whatever it serves; a
    model id other than the served one is refused)."""

    def __init__(self, model_id: str | None = None, client: Connection | None = None):
        self.client = current_client(client)
        served = self.client.base_model
        if model_id is not None and not serves(served, model_id):
            raise ValueError(f"the server serves {served!r}, not {model_id!r}")
        self.model_id = served
        self.adapters: dict[str, Adapter] = {}
        self.served_template: Any = False  # the served model's vision-language template, read when needed

    @property
    def runs(self) -> dict[str, Any]:
        return {name: a.run for name, a in self.adapters.items()}

    def _get(self, adapter_name: str | None) -> Adapter:
        if adapter_name is None and len(self.adapters) == 1:
            return next(iter(self.adapters.values()))
        if adapter_name not in self.adapters:
            raise KeyError(
                f"no adapter {adapter_name!r}; add_adapter_to_model({adapter_name!r}, config) first"
            )
        return self.adapters[adapter_name]

    # ---------------------------------------------------------------- set-up
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config: Any,
        gradient_accumulation_steps: int = 1,
        save_dir: str | None = None,
    ) -> None:
        """A LoRA run of ``config``'s rank (the server's LoRA: every linear layer, alpha 32, no
        dropout). ``save_dir``, upstream's folder on the server: each ``save`` also writes the
        checkpoint there (``<save_dir>/weights|sampler_weights/<name>``); only a server started
        without keys takes it (it writes to the server's files), and the folder must exist."""
        rank = config.get("r", 8) if isinstance(config, dict) else getattr(config, "r", 8)
        warn_unapplied(adapter_name, config)
        window = window_steps(gradient_accumulation_steps)
        meta = (
            None if save_dir is None else {"twinkle_save_dir": os.path.abspath(os.path.expanduser(save_dir))}
        )
        run = self.client.service.create_lora_training_client(
            base_model=self.model_id, rank=int(rank), train_unembed=False, user_metadata=meta
        ).result()
        self.adapters[adapter_name] = Adapter(run, int(rank), window, save_dir)

    def set_template(self, template_cls: str, adapter_name: str | None = None, **kwargs: Any) -> None:
        """The template (a ``twinkle.template`` name or class, built with ``kwargs``; one it does
        not take is refused by name) that encodes un-encoded rows (``messages``) here, before
        they are sent."""
        from twinkle.template.registry import get_template

        kwargs.setdefault("model_id", local_model_id(self.model_id))
        self._get(adapter_name).template = (template_cls, get_template(template_cls, **kwargs))

    def set_processor(self, processor_cls: str, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Rows travel unpadded, one datum each, so the padding settings change nothing."""
        self._get(adapter_name)
        if processor_cls not in PROCESSORS or set(kwargs) - set(PROCESSORS[processor_cls]):
            raise ValueError(f"set_processor: takes {list(PROCESSORS)} with {PROCESSORS['InputProcessor']}")

    def set_loss(self, loss_cls: str, adapter_name: str | None = None, **kwargs: Any) -> None:
        from twinkle.loss.registry import build_loss

        a = self._get(adapter_name)
        a.loss = build_loss(loss_cls, **kwargs)  # the local constructor checks the arguments
        a.loss_name, a.loss_args = loss_cls, kwargs

    def set_optimizer(
        self, optimizer_cls: str = "AdamW", lr: float = 1e-5, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        self._get(adapter_name).optim = AdamSettings(optimizer_cls, lr, **kwargs)

    def set_lr_scheduler(
        self,
        scheduler_cls: Any,
        num_warmup_steps: int = 0,
        num_training_steps: int | None = None,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        a = self._get(adapter_name)
        a.optim.set_schedule(scheduler_cls, num_warmup_steps, num_training_steps, a.window, kwargs)

    def add_metric(
        self, metric_cls: str, is_training: bool | None = None, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """A local metric by name (``twinkle.metric.METRICS``), built with ``kwargs`` (its
        constructor refuses one it does not take); ``is_training`` True: training steps, False:
        ``forward_only`` calls, None: both. ``LossMetric`` is already in every report. A metric
        that needs what never reaches the client is refused by name (``NO_METRIC``)."""
        from twinkle.metric.registry import build_metric

        a = self._get(adapter_name)
        name = (
            metric_cls if isinstance(metric_cls, str) else getattr(metric_cls, "__name__", repr(metric_cls))
        )
        if name in NO_METRIC:
            raise ValueError(f"add_metric({name!r}): not available over twinkle server: {NO_METRIC[name]}")
        metric = build_metric(metric_cls, **kwargs)
        if name != "LossMetric":  # calculate_metric reports the loss of every window
            a.added.append((metric, is_training))

    def _feed(self, a: Adapter, training: bool, context: dict[str, Any]) -> None:
        """Hand the metrics of ``training`` (or evaluation) the micro-batches seen since the
        last feed, as the local model does once the step that used them is known."""
        for inputs, outputs, values in a.pending:
            for metric, when in a.added:
                if when is None or when == training:
                    metric.accumulate(inputs, outputs, **values, **context)
        a.pending = []

    @staticmethod
    def _seen(
        rows: list[dict], logps: torch.Tensor, values: dict[str, Any], loss: float, count: int
    ) -> tuple:
        """One micro-batch as the local model hands it to a metric: labels shifted (position
        ``i`` predicts label ``i + 1``), each label's log-prob at the same place, the step's
        values aligned the same."""
        labels = batches.labels_of(rows)[:, 1:]
        shifted = {k: v[:, 1:] if torch.is_tensor(v) and v.ndim == 2 else v for k, v in values.items()}
        outputs = {"logps": logps[:, 1:], "loss": loss, "num_tokens": count}
        if "ref_logps" in shifted:
            outputs["ref_logps"] = shifted.pop("ref_logps")
        return {"labels": labels}, outputs, shifted

    # ---------------------------------------------------------------- steps
    def _rows(self, a: Adapter, inputs: Any) -> list[dict]:
        rows = [inputs] if isinstance(inputs, dict) and "messages" in inputs else inputs
        trajectories: list[Any] = []  # the rows' own, when they are encoded here
        if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "input_ids" not in rows[0]:
            if a.template is None:
                raise ValueError("rows without input_ids need set_template(...) first")
            trajectories, rows = rows, [a.template[1].encode(r) for r in rows]
        rows = batches.rows_of(rows)
        for i, row in enumerate(rows):
            if image_prompts.has_images(row) and image_prompts.gemma(template := self._vision(a)):
                given = trajectories[i] if trajectories else None
                row["chunked"] = image_prompts.training_input(row, template, f"row {i}", given)
        return rows

    def _vision(self, a: Adapter) -> Any:
        """The template whose rows' images are sent: the adapter's own vision-language one, else
        the served model's (``image_prompts.served_template``; None for a text model)."""
        if a.template is not None and hasattr(a.template[1], "image_token_id"):
            return a.template[1]
        if self.served_template is False:
            self.served_template = image_prompts.served_template(self.model_id)
        return self.served_template

    def _step_values(self, a: Adapter, labels: Any, given: dict[str, Any]) -> dict[str, Any]:
        reads = set(getattr(a.loss, "extra_inputs", ()))
        given = {k: v for k, v in given.items() if v is not None}
        unread = sorted(k for k in given if k not in reads)
        if unread:
            raise ValueError(
                f"{a.loss_name} does not read {', '.join(unread)}; set_loss(...) the loss that does"
            )
        missing = sorted(k for k in reads if k in STEP_VALUES and k not in given)
        if missing:
            raise ValueError(f"{a.loss_name} needs {', '.join(missing)}")
        return {STEP_VALUES[k]: batches.per_label(k, v, labels) for k, v in given.items()}

    def _config(self, a: Adapter) -> dict[str, Any]:
        if a.loss is None or (a.loss_name == "CrossEntropyLoss" and not a.loss_args):
            return dict(TOKEN_MEAN)
        config: dict[str, Any] = {"twinkle_loss": a.loss_name, **TOKEN_MEAN}
        if tasks.embeds(a.loss):
            config.update(tasks.TASK)
        for k, v in a.loss_args.items():
            if v is None:
                continue  # the constructor's own default was checked by build_loss
            if not isinstance(v, int | float | str):
                raise ValueError(f"{a.loss_name}({k}=...): only numbers and text travel to the server")
            config[k] = float(v) if isinstance(v, bool | int) else v
        return config

    def forward_backward(
        self,
        inputs: Any,
        adapter_name: str | None = None,
        ref_outputs: Any = None,
        ref_logps: Any = None,
        old_logps: Any = None,
        advantages: Any = None,
        task: str | None = None,
        teacher_topk_logprobs: Any = None,
        teacher_topk_indices: Any = None,
    ) -> StepResult:
        """One micro-batch: its gradient joins the window; returns the mean loss per counted
        token (per pair for a preference loss, per group for InfoNCE) as a float with ``result``
        beside it. ``task``: upstream's choice of head: the language model's (None,
        ``'causal_lm'``), or ``'embedding'`` (rows with ``labels`` 1 at each anchor, 0 after it,
        and ``set_loss('InfonceLoss', ...)``; ``result["embeddings"]`` holds the rows' pooled
        embeddings). ``teacher_topk_logprobs``/``teacher_topk_indices``: ``GKDLoss``'s teacher,
        ``(B, L, k)`` in the local layout (``twinkle_client.tasks``)."""
        a = self._get(adapter_name)
        if tasks.task_of(task) == "embedding":
            if not tasks.embeds(a.loss):
                raise ValueError(
                    f"task='embedding' needs a loss over embeddings for embedding training "
                    f"(set_loss('InfonceLoss', ...)), not {a.loss_name}"
                )
            return self._embedding_step(a, inputs, training=True)
        if tasks.embeds(a.loss):
            raise ValueError(f"{a.loss_name} trains embeddings; run the step with task='embedding'")
        rows = self._rows(a, inputs)
        labels = batches.labels_of(rows)
        ref = ref_logps if ref_logps is not None else ref_outputs
        values = self._step_values(
            a, labels, {"ref_logps": ref, "old_logps": old_logps, "advantages": advantages}
        )
        config = self._config(a)
        data = tasks.step_datums(a.loss_name, rows, values, teacher_topk_logprobs, teacher_topk_indices)
        out = a.run.forward_backward(data, "cross_entropy", config).result()
        logps = batches.logps_per_label(rows, [o["logprobs"].tolist() for o in out.loss_fn_outputs])
        total = float(out.metrics["loss:sum"])
        count = int(out.metrics.get("num_tokens:sum", float((labels[:, 1:] != -100).sum())))
        a.window_loss, a.window_count = a.window_loss + total, a.window_count + count
        a.micro, a.cur_step, a.consumed = a.micro + 1, a.cur_step + 1, a.consumed + len(rows)
        if a.added:
            local = {LOCAL_NAMES[k]: v for k, v in values.items()}
            a.pending.append(self._seen(rows, logps, local, total, count))
        mean = total / max(1, count)
        return StepResult(mean, {"loss": mean, "logps": logps, "num_tokens": count})

    def forward_only(
        self,
        inputs: Any,
        adapter_name: str | None = None,
        disable_lora: bool = False,
        task: str | None = None,
    ) -> Response:
        """``result``: ``{"loss": mean cross entropy per trained token, "logps": (B, L) each
        label's log-prob, 0 where it is -100, "num_tokens"}``; ``disable_lora``: the base
        model's (a DPO reference: ``forward_backward(ref_outputs=...)`` takes it).
        ``task='embedding'``: ``{"embeddings": (B, D), "loss", "num_tokens"}``, the loss (NaN
        without one) when an embedding loss is set and the rows' marks form groups."""
        a = self._get(adapter_name)
        if tasks.task_of(task) == "embedding":
            if disable_lora:
                raise ValueError(
                    "forward_only(task='embedding'): disable_lora is not supported over twinkle server"
                )
            return self._embedding_step(a, inputs, training=False)
        rows = self._rows(a, inputs)
        config = {"disable_lora": 1.0} if disable_lora else {}
        out = a.run.forward(batches.datums_of(rows), "cross_entropy", config).result()
        logps = batches.logps_per_label(rows, [o["logprobs"].tolist() for o in out.loss_fn_outputs])
        count = int((batches.labels_of(rows)[:, 1:] != -100).sum())
        total = float(out.metrics["loss:sum"])
        if not disable_lora:  # the adapter's evaluation; a reference pass is not one
            a.eval_loss, a.eval_count = a.eval_loss + total, a.eval_count + count
            if a.added:
                a.pending.append(self._seen(rows, logps, {}, total, count))
                self._feed(a, False, {})
        return Response({"loss": total / max(1, count), "logps": logps, "num_tokens": count})

    def _embedding_step(self, a: Adapter, inputs: Any, training: bool) -> Any:
        """``task='embedding'``: the rows as one request (its rows are the in-batch negatives);
        the added metrics see the marks, the embeddings and the loss, as the local ones do."""
        data, marks = tasks.embedding_datums(inputs, marks=training)
        config = dict(tasks.TASK)
        if tasks.embeds(a.loss):
            config = self._config(a)
        if training:
            out = a.run.forward_backward(data, "cross_entropy", config).result()
        else:
            out = a.run.forward(data, "cross_entropy", config).result()
        embeddings = tasks.embeddings_of(out)
        count = int(out.metrics.get("num_tokens:sum", 0))
        total = float(out.metrics.get("loss:sum", 0.0))
        mean = total / count if count else float("nan")
        if training:
            a.window_loss, a.window_count = a.window_loss + total, a.window_count + count
            a.micro, a.cur_step, a.consumed = a.micro + 1, a.cur_step + 1, a.consumed + len(data)
        elif count:
            a.eval_loss, a.eval_count = a.eval_loss + total, a.eval_count + count
        if a.added:
            outputs = {"loss": total, "num_tokens": count, "embeddings": embeddings}
            a.pending.append(({"labels": marks}, outputs, {}))
            if not training:
                self._feed(a, False, {})
        result = {"loss": mean, "embeddings": embeddings, "num_tokens": count}
        return StepResult(mean, result) if training else Response(result)

    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> bool:
        """Once the window holds ``gradient_accumulation_steps`` micro-batches: clip the
        window's gradient to ``max_grad_norm`` (0 or None: no clipping), AdamW, the schedule's
        next rate. Before that, False and the window stays open."""
        if norm_type != 2:
            raise ValueError(f"clip_grad_and_step: the server clips the L2 norm, not norm_type={norm_type}")
        a = self._get(adapter_name)
        if gradient_accumulation_steps is not None:
            a.window = window_steps(gradient_accumulation_steps)
        if a.micro < a.window:
            return False
        metrics = a.run.optim_step(a.optim.adam_params(max_grad_norm or 0.0)).result().metrics or {}
        a.metrics = {
            "loss": a.window_loss / max(1, a.window_count),
            "grad_norm": float(metrics.get("grad_norm", float("nan"))),
            "lr": a.optim.lr,
        }
        context = {"lr": a.optim.lr, "step": a.cur_step, "gradient_accumulation_steps": a.window}
        self._feed(a, True, {**context, "grad_norm": a.metrics["grad_norm"]})
        a.optim.stepped()
        a.micro, a.window_loss, a.window_count = 0, 0.0, 0
        return bool(metrics.get("stepped", 1.0))

    def zero_grad(self, adapter_name: str | None = None) -> None:
        """Nothing to do: the server closes the window at each optimizer step."""

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> Response:
        """Training: the last optimizer step's ``loss`` (mean per counted token of its window),
        ``grad_norm`` and ``lr``, and the added metrics' numbers over the steps since the last
        call. Evaluation (``is_training=False``): the mean loss of the ``forward_only`` calls
        since the last call, and the evaluation metrics' numbers."""
        a = self._get(adapter_name)
        if is_training:
            out = dict(a.metrics)
        else:
            out = {"loss": a.eval_loss / a.eval_count} if a.eval_count else {}
            a.eval_loss, a.eval_count = 0.0, 0
        for metric, when in a.added:
            if when is None or when == is_training:
                out.update(metric.calculate())
        return Response(out)

    def get_train_configs(self, adapter_name: str | None = None) -> TrainConfigs:
        a = self._get(adapter_name)
        configs = {
            "model_id": self.model_id,
            "lora_rank": a.rank,
            "gradient_accumulation_steps": a.window,
            "loss": a.loss_name,
            "loss_args": a.loss_args,
            **a.optim.describe(),
        }
        return TrainConfigs(", ".join(f"{k}={v}" for k, v in configs.items()), configs)

    # ---------------------------------------------------------------- checkpoints
    def save(
        self,
        name: str,
        is_sampler: bool = False,
        save_optimizer: bool = True,
        consumed_train_samples: int | None = None,
        adapter_name: str | None = None,
    ) -> SaveResponse:
        """A checkpoint named ``name`` (replacing one of that name, as the local save does) with
        the progress ``resume_from_checkpoint`` returns (``consumed_train_samples`` given here
        replaces the client's count of trained rows): the adapter and its optimizer state, or
        with ``save_optimizer=False`` the adapter alone (a ``sampler_weights`` checkpoint on the
        server: ``load`` and ``resume_from_checkpoint`` find it by the same name and restore the
        weights, a fresh optimizer). ``is_sampler``: the adapter's weights for sampling."""
        a = self._get(adapter_name)
        if consumed_train_samples is not None:
            a.consumed = int(consumed_train_samples)
        progress = {"cur_step": str(a.cur_step), "consumed_train_samples": str(a.consumed)}
        if is_sampler:
            path = a.run.save_weights_for_sampler(name).result().path
        elif not save_optimizer:
            path = a.run.save_weights_for_sampler(name, user_metadata=progress).result().path
            a.saved_weights_only.add(name)
        else:
            path = a.run.save_state(name, overwrite=True, user_metadata=progress).result().path
            a.saved_weights_only.discard(name)
        return SaveResponse(path.replace("tinker://", "twinkle://", 1))

    def save_for_sampler(self, name: str, adapter_name: str | None = None) -> str:
        return self.save(name, is_sampler=True, adapter_name=adapter_name).twinkle_path

    def _path(self, a: Adapter, name: str) -> str:
        if "://" in name:
            return as_tinker_path(name)
        kind = "sampler_weights" if name in a.saved_weights_only else "weights"
        return f"tinker://{a.run.model_id}/{kind}/{name}"

    def load(self, name: str, load_optimizer: bool = False, adapter_name: str | None = None) -> None:
        """The checkpoint's adapter weights, and with ``load_optimizer`` its optimizer state (a
        checkpoint saved without one is refused rather than loaded with a fresh optimizer)."""
        a = self._get(adapter_name)
        path = self._path(a, name)
        if load_optimizer and "/sampler_weights/" in path:
            raise ValueError(
                f"load({name!r}, load_optimizer=True): that checkpoint holds no optimizer state "
                "(saved with save_optimizer=False or is_sampler=True); pass load_optimizer=False"
            )
        (a.run.load_state_with_optimizer(path) if load_optimizer else a.run.load_state(path)).result()

    def resume_from_checkpoint(
        self, name: str, resume_only_model: bool = False, adapter_name: str | None = None
    ) -> dict[str, int]:
        """Load the checkpoint (with its optimizer state unless ``resume_only_model`` or it has
        none) and return its progress ``{"cur_step", "consumed_train_samples"}``, which the
        counters take up."""
        a = self._get(adapter_name)
        path = self._path(a, name)
        weights_only = resume_only_model or "/sampler_weights/" in path
        self.load(path, load_optimizer=not weights_only, adapter_name=adapter_name)
        found = [c for c in self.client.list_checkpoints(path.split("/")[2]) if c.tinker_path == path]
        meta = (found[0].user_metadata or {}) if found else {}
        a.cur_step = int(meta.get("cur_step", 0))
        a.consumed = int(meta.get("consumed_train_samples", 0))
        a.micro, a.pending = 0, []
        return {"cur_step": a.cur_step, "consumed_train_samples": a.consumed}

    def remove_adapter(self, adapter_name: str) -> None:
        self.adapters.pop(adapter_name)
