"""``curves.png``: train loss, eval loss and learning rate against the step, from ``metrics.jsonl``.

Drawn from the file, not from memory, so a resumed run's picture holds the whole run and a
crashed one can still be drawn (``draw_curves(output_dir)``). matplotlib is imported here, with
the Agg backend (no display), only when a picture is drawn."""

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from twinkle.utils.errors import UserError
from twinkle.utils.fileio import refuse_link_message, umask_mode

LINES = (("train", "loss"), ("eval", "loss"), ("train", "lr"))


def read_records(path: Path) -> list[dict]:
    """The JSON lines of ``path``; a torn last line (a killed run) is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(
    records: list[dict], kind: str, name: str, adapter: str | None = None
) -> tuple[list[int], list[float]]:
    by_step: dict[int, float] = {}  # a resumed run may repeat steps: the later record wins
    for r in records:
        value = r.get(name)
        if adapter is not None and r.get("adapter", "default") != adapter:
            continue
        if r.get("kind") == kind and isinstance(value, int | float) and math.isfinite(value):
            by_step[int(r["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def draw_curves(jsonl: Path, png: Path) -> Path | None:
    """Write ``png`` from ``jsonl``: losses on the top panel, the learning rate below, sharing
    the step axis. Returns the picture, or None when there is nothing to draw."""
    records = read_records(jsonl) if jsonl.is_file() else []
    adapters = list(dict.fromkeys(r.get("adapter", "default") for r in records))
    return _draw(records, png, adapters if len(adapters) > 1 else [None])  # several: a line of each


def _draw(records: list[dict], png: Path, adapters: list[str | None]) -> Path | None:
    """One train loss, eval loss and lr line per adapter (None: all records, unnamed lines)."""
    lines = {a: [_series(records, k, n, a) for k, n in LINES] for a in adapters}
    if not any(train[0] or evals[0] for train, evals, _ in lines.values()):
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True
    )
    for i, (adapter, (train, evals, lr)) in enumerate(lines.items()):
        tag, style = ("", "-") if adapter is None else (f"{adapter}: ", ("-", "--", ":", "-.")[i % 4])
        marker = "." if len(train[0]) < 50 else None
        top.plot(*train, label=f"{tag}train loss", color="tab:blue", linestyle=style, marker=marker)
        top.plot(*evals, label=f"{tag}eval loss", color="tab:orange", linestyle=style, marker="o")
        bottom.plot(*lr, label=f"{tag}learning rate", color="tab:green", linestyle=style)
    top.set_ylabel("loss (mean per token)")
    top.set_title(f"{png.parent.name or 'run'}: loss and learning rate")
    top.grid(True, alpha=0.3)
    top.legend()
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step (micro-batches)")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    bottom.grid(True, alpha=0.3)
    bottom.legend()
    _save(fig, png)
    plt.close(fig)
    return png


def _save(fig, png: Path) -> None:  # noqa: ANN001 - a matplotlib Figure
    """Write ``png`` through a fresh temporary file and a rename: neither write follows a link,
    and a link at ``png`` is refused rather than replaced."""
    if png.is_symlink():
        raise UserError(refuse_link_message(png, "--output-dir"))
    fd, tmp = tempfile.mkstemp(prefix=f".{png.name}.", suffix=".png", dir=png.parent)
    try:
        os.fchmod(fd, umask_mode(folder=False))
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, format="png", dpi=110)
        os.replace(tmp, png)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
