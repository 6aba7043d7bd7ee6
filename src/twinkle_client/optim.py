"""The optimizer settings and learning-rate schedule of one adapter trained on a ``twinkle server``.

The server's optimizer is torch's AdamW. ``Adam`` without weight decay is the same update, so
both names are taken; each keeps torch's defaults, as the local ``set_optimizer`` does. The
schedule runs here, on a stand-in optimizer of one parameter, with the local schedules
(``twinkle.optim.scheduler.build_scheduler``); each step sends the learning rate it gives."""

from typing import Any

import torch

ADAM_KEYS = ("betas", "eps", "weight_decay")


class AdamSettings:
    def __init__(self, optimizer_cls: str = "AdamW", lr: float = 1e-5, **kwargs: Any):
        name = str(optimizer_cls)
        if name not in ("Adam", "AdamW"):
            raise ValueError(f"set_optimizer: twinkle server steps with AdamW; {name!r} is not available")
        unknown = sorted(set(kwargs) - set(ADAM_KEYS))
        if unknown:
            raise ValueError(
                f"set_optimizer({name!r}): unsupported argument(s) {unknown}; it takes lr, {', '.join(ADAM_KEYS)}"
            )
        default_decay = 0.0 if name == "Adam" else 0.01  # torch's defaults
        self.weight_decay = float(kwargs.get("weight_decay", default_decay))
        if name == "Adam" and self.weight_decay != 0.0:
            raise ValueError(
                "set_optimizer('Adam', weight_decay=...): Adam's L2 penalty is not AdamW's decay; use 'AdamW'"
            )
        self.betas = tuple(float(b) for b in kwargs.get("betas", (0.9, 0.999)))
        self.eps = float(kwargs.get("eps", 1e-8))
        self.name = name
        self.stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(lr))
        self.schedule: Any = None

    @property
    def lr(self) -> float:
        return float(self.stand_in.param_groups[0]["lr"])

    def set_schedule(
        self,
        scheduler_cls: Any,
        num_warmup_steps: int,
        num_training_steps: int | None,
        window: int,
        kwargs: dict,
    ) -> None:
        """As the local ``set_lr_scheduler``: ``num_training_steps`` counts micro-batches."""
        from twinkle.optim.scheduler import build_scheduler

        steps = None if num_training_steps is None else -(-int(num_training_steps) // window)
        self.schedule = build_scheduler(scheduler_cls, self.stand_in, num_warmup_steps, steps, **kwargs)

    def adam_params(self, clip: float) -> Any:
        from tinker import types

        return types.AdamParams(
            learning_rate=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decay=self.weight_decay,
            grad_clip_norm=float(clip or 0.0),
        )

    def stepped(self) -> None:
        if self.schedule is not None:
            self.schedule.step()

    def describe(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
