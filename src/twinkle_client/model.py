"""``MultiLoraTransformersModel`` over a ``twinkle server``: the local class's training calls,
each adapter a Tinker training run on the server.

Rows are the local API's encoded rows (``{"input_ids": [...], "labels": [...]}``, labels
aligned with the inputs, -100 where a token is not trained) or a batch of such tensors; they
go to the server as Tinker datums with the cross-entropy loss (weight 1 on each trained
token). ``forward_backward`` returns the mean loss per trained token, as the local one does,
and asks the server for the local API's gradient (the mean over the trained tokens of the
step's window, ``loss_fn_config={"twinkle_reduction": "token_mean"}``) rather than Tinker's
sum. The optimizer is AdamW (the server's); ``set_optimizer`` keeps its settings for the steps."""

from typing import Any

from twinkle_client.connection import Connection, current_client

IGNORE = -100
TOKEN_MEAN = {"twinkle_reduction": "token_mean"}  # the local API's gradient (the engine's key)


def _as_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def datums_of(inputs: Any) -> tuple[list[Any], float]:
    """(Tinker datums, trained-token count) of encoded rows or a batch of tensors."""
    from tinker import types

    if isinstance(inputs, dict) and hasattr(inputs.get("input_ids"), "shape"):
        mask = inputs.get("attention_mask")
        rows = []
        for b in range(len(inputs["input_ids"])):
            n = int(mask[b].sum()) if mask is not None else len(inputs["input_ids"][b])
            rows.append(
                {
                    "input_ids": _as_list(inputs["input_ids"][b])[:n],
                    "labels": _as_list(inputs["labels"][b])[:n],
                }
            )
    else:
        rows = [inputs] if isinstance(inputs, dict) else list(inputs)
    data, count = [], 0.0
    for i, row in enumerate(rows):
        ids, labels = _as_list(row["input_ids"]), _as_list(row["labels"])
        if len(ids) != len(labels) or len(ids) < 2:
            raise ValueError(f"row {i}: input_ids and labels must have the same length, at least 2")
        weights = [0.0 if t == IGNORE else 1.0 for t in labels[1:]]
        targets = [ids[k + 1] if t == IGNORE else t for k, t in enumerate(labels[1:])]
        count += sum(weights)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": targets, "weights": weights},
            )
        )
    return data, count


class MultiLoraTransformersModel:
    """Adapters trained on the server's base model (``model_id`` None: whatever it serves)."""

    def __init__(self, model_id: str | None = None, client: Connection | None = None, **kwargs: Any):
        self.client = current_client(client)
        self.model_id = model_id or self.client.base_model
        self.runs: dict[str, Any] = {}  # adapter name -> tinker TrainingClient
        self.adam: dict[str, dict[str, float]] = {}

    def _run(self, adapter_name: str | None) -> Any:
        if adapter_name is None and len(self.runs) == 1:
            adapter_name = next(iter(self.runs))
        if adapter_name not in self.runs:
            raise KeyError(
                f"no adapter {adapter_name!r}; add_adapter_to_model({adapter_name!r}, config) first"
            )
        return adapter_name, self.runs[adapter_name]

    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        rank = config.get("r", 8) if isinstance(config, dict) else getattr(config, "r", 8)
        self.runs[adapter_name] = self.client.service.create_lora_training_client(
            base_model=self.model_id, rank=int(rank)
        ).result()
        self.adam[adapter_name] = {"learning_rate": 1e-4}

    def set_optimizer(
        self, optimizer_cls: str = "AdamW", lr: float = 1e-4, adapter_name: str | None = None, **kw: Any
    ) -> None:
        if str(optimizer_cls).lower() not in ("adamw", "adam"):
            raise ValueError(f"the server's optimizer is AdamW, not {optimizer_cls}")
        name, _ = self._run(adapter_name)
        betas = kw.get("betas", (0.9, 0.95))
        self.adam[name] = {
            "learning_rate": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": kw.get("eps", 1e-12),
            "weight_decay": kw.get("weight_decay", 0.0),
        }

    def forward_backward(self, inputs: Any, adapter_name: str | None = None, **kwargs: Any) -> float:
        _, run = self._run(adapter_name)
        data, count = datums_of(inputs)
        out = run.forward_backward(data, "cross_entropy", TOKEN_MEAN).result()
        return out.metrics["loss:sum"] / max(1.0, count)

    def forward_only(self, inputs: Any, adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """``{"loss": mean loss per trained token, "logps": per row, each target's log-prob}``."""
        _, run = self._run(adapter_name)
        data, count = datums_of(inputs)
        out = run.forward(data, "cross_entropy").result()
        logps = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
        return {"loss": out.metrics["loss:sum"] / max(1.0, count), "logps": logps}

    def clip_grad_and_step(
        self, max_grad_norm: float = 1.0, adapter_name: str | None = None, **kwargs: Any
    ) -> bool:
        from tinker import types

        name, run = self._run(adapter_name)
        params = types.AdamParams(**self.adam[name], grad_clip_norm=float(max_grad_norm or 0.0))
        metrics = run.optim_step(params).result().metrics or {}
        return bool(metrics.get("stepped", 1.0))

    def step(self, adapter_name: str | None = None, **kwargs: Any) -> bool:
        return self.clip_grad_and_step(0.0, adapter_name=adapter_name)

    def zero_grad(self, adapter_name: str | None = None) -> None:
        """Nothing to do: the server closes the window at each step."""

    def save(self, name: str, adapter_name: str | None = None, **kwargs: Any) -> str:
        """Adapter and optimizer state; returns its ``tinker://`` path."""
        _, run = self._run(adapter_name)
        return run.save_state(name, overwrite=True).result().path  # as the local save replaces it

    def save_for_sampler(self, name: str, adapter_name: str | None = None) -> str:
        _, run = self._run(adapter_name)
        return run.save_weights_for_sampler(name).result().path

    def resume_from_checkpoint(self, path: str, adapter_name: str | None = None, **kwargs: Any) -> None:
        _, run = self._run(adapter_name)
        run.load_state_with_optimizer(path).result()

    def remove_adapter(self, adapter_name: str) -> None:
        self.runs.pop(adapter_name)
        self.adam.pop(adapter_name, None)
