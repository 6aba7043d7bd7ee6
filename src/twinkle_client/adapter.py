"""One adapter of the client's model: its run on the server, what the client keeps for it
(optimizer settings, loss, window, metrics), and the checks on what ``add_adapter_to_model``
is given (the server applies only the LoRA rank; the window is a whole number)."""

import warnings
from typing import Any

from twinkle_client.optim import AdamSettings

# the server's LoRA (``twinkle.server.datums.lora_config``): what a config may say and still be it
SERVER_LORA = {
    "lora_alpha": (32,),
    "lora_dropout": (0, 0.0),
    "target_modules": ("all-linear",),
    "use_rslora": (False,),
    "bias": ("none",),
}


def warn_unapplied(adapter_name: str, config: Any) -> None:
    """One warning naming each field of ``config`` (a ``peft.LoraConfig`` or a dict) that the
    server's LoRA does not apply: only the rank travels (upstream's client scripts set
    ``lora_dropout=0.05``, which would stop them if it were refused)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    unapplied = [
        f"{k}={get(k)!r}"
        for k, allowed in SERVER_LORA.items()
        if get(k) is not None and get(k) not in allowed
    ]
    if unapplied:
        warnings.warn(
            f"add_adapter_to_model({adapter_name!r}): {', '.join(unapplied)} is not applied over twinkle "
            "server; its LoRA is on every linear layer of the blocks, alpha 32, no dropout, at your rank",
            stacklevel=3,
        )


class Adapter:
    """One adapter's run on the server and what the client keeps for it."""

    def __init__(self, run: Any, rank: int, window: int, save_dir: str | None):
        self.run, self.rank, self.window, self.save_dir = run, rank, window, save_dir
        self.optim = AdamSettings()
        self.loss_name, self.loss_args, self.loss = "CrossEntropyLoss", {}, None
        self.micro = 0  # forward_backward calls since the last optimizer step
        self.cur_step = 0  # micro-batches, as the local optimizer group counts them
        self.consumed = 0  # rows trained on
        self.window_loss, self.window_count = 0.0, 0
        self.metrics: dict[str, float] = {}
        self.template: Any = None
        self.added: list[tuple[Any, bool | None]] = []  # (metric, is_training) from add_metric
        self.pending: list[tuple[dict, dict, dict]] = []  # the window's micro-batches, for them
        self.eval_loss, self.eval_count = 0.0, 0
        self.saved_weights_only: set[str] = set()  # names saved with save_optimizer=False


def window_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a whole number >= 1, got {steps!r}")
    return steps
