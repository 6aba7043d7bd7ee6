"""Where a run's metric records go besides ``metrics.jsonl``: ``--report-to``.

``REPORT_TO`` names the choices. ``parse_report_to`` turns the flag's comma list into names and
refuses an unknown one or one whose library is missing (one line naming the pip command), so a
typo fails before the model loads. ``open_sinks`` builds a writer per name; each takes
``log(kind, step, numbers)`` and ``close()``. The libraries are imported only here, when a run
asks for them: ``import twinkle`` never loads them."""

import importlib.util
import os
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import refuse_link_message

REPORT_TO = ("none", "tensorboard", "wandb", "swanlab")
# The folders the sinks write under the output dir; a link there is refused, never written through.
SINK_FOLDERS = ("tensorboard", "wandb", "swanlab")
# name -> (module to import, pip command that provides it)
_LIBRARIES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'twinkle[wandb]'"),
    "swanlab": ("swanlab", "pip install 'twinkle[swanlab]'"),
}


def parse_report_to(value: str | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ``("tensorboard", "wandb")``; ``none`` or empty -> ``()``."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown:
        raise UserError(f"--report-to: unknown {', '.join(unknown)}; valid names: {', '.join(REPORT_TO)}")
    if "none" in names and len(names) > 1:
        raise UserError("--report-to: 'none' cannot be combined with other names")
    chosen = tuple(dict.fromkeys(n for n in names if n != "none"))
    for name in chosen:
        module, pip = _LIBRARIES[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--report-to {name} needs the {module} package; install it with: {pip}")
    return chosen


class TensorBoardSink:
    """Scalars ``train/<name>`` and ``eval/<name>`` in event files under ``<output_dir>/tensorboard``."""

    def __init__(self, output_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def log(self, kind: str, step: int, numbers: dict[str, float]) -> None:
        for name, value in numbers.items():
            self.writer.add_scalar(f"{kind}/{name}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in ``<output_dir>``; offline (synced later with ``wandb sync``) without a key.

    ``name`` names the run. ``one_of_many``: the process holds other wandb runs at the same time
    (``twinkle server``, one per training run), so this init makes a run of its own beside them
    (``reinit="create_new"``) and does not capture the console, which belongs to no single run."""

    def __init__(
        self, output_dir: Path, config: dict[str, Any], name: str | None = None, one_of_many: bool = False
    ):
        import wandb

        online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "twinkle"),
            dir=str(output_dir),
            config=config,
            mode="online" if online else "offline",
            name=name,
            settings=wandb.Settings(reinit="create_new", console="off") if one_of_many else None,
        )

    def log(self, kind: str, step: int, numbers: dict[str, float]) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanlabSink:
    """A swanlab experiment logged under ``<output_dir>/swanlab``; offline without a key. swanlab
    holds one experiment per process at a time."""

    def __init__(self, output_dir: Path, config: dict[str, Any]):
        import swanlab

        online = bool(os.environ.get("SWANLAB_API_KEY"))
        self.swanlab = swanlab
        self.run = swanlab.init(
            project=os.environ.get("SWANLAB_PROJECT", "twinkle"),
            logdir=str(output_dir / "swanlab"),
            config=config,
            mode="cloud" if online else "offline",
        )

    def log(self, kind: str, step: int, numbers: dict[str, float]) -> None:
        self.swanlab.log({f"{kind}/{k}": v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        self.swanlab.finish()


def open_sinks(names: tuple[str, ...], output_dir: Path, config: dict[str, Any]) -> list[Any]:
    sinks: list[Any] = []
    for name in names:
        if (output_dir / name).is_symlink():
            raise UserError(refuse_link_message(output_dir / name, "--output-dir"))
        if name == "tensorboard":
            sinks.append(TensorBoardSink(output_dir))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, config))
        elif name == "swanlab":
            sinks.append(SwanlabSink(output_dir, config))
    return sinks
