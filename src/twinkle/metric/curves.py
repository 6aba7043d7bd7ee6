"""``curves.png``: train and eval loss, the rewards of preference and RL runs, and the learning rate
against the step, from ``metrics.jsonl``.

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
PREFERENCE_SCORES = ("reward_margin", "reward_accuracy")  # DPOMetric's


def is_score(name: str) -> bool:
    """What a preference or RL run is judged by, drawn in a panel of its own (a GRPO loss sits
    near 0 whatever the policy learns): ``DPOMetric``'s margin and accuracy,
    ``CompletionRewardMetric``'s mean rewards (``train/<name>_reward``) and held-out accuracies
    (``eval/<name>accuracy``, as the GRPO cookbook's ``eval/greedy_accuracy``)."""
    return (
        name in PREFERENCE_SCORES
        or (name.startswith("train/") and name.endswith("_reward"))
        or (name.startswith("eval/") and name.endswith("accuracy"))
    )


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


def score_series(records: list[dict], adapter: str | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """Each score (``is_score``) the records hold, by label: ``<kind> <name>`` (``train
    reward_margin``), or the name alone where it already says its kind (``eval/greedy_accuracy``)."""
    found = {}
    names = dict.fromkeys(n for r in records for n in r if is_score(n))  # first seen first
    for name in sorted(names, key=lambda n: n not in PREFERENCE_SCORES):
        for kind in ("train", "eval"):
            steps, values = _series(records, kind, name, adapter)
            if steps:
                found[name if "/" in name else f"{kind} {name}"] = (steps, values)
    return found


def draw_curves(jsonl: Path, png: Path) -> Path | None:
    """Write ``png`` from ``jsonl``: losses on the top panel, the scores (``is_score``, where there
    are any) below them, the learning rate at the bottom, sharing the step axis. Returns the
    picture, or None when there is nothing to draw."""
    records = read_records(jsonl) if jsonl.is_file() else []
    adapters = list(dict.fromkeys(r.get("adapter", "default") for r in records))
    return _draw(records, png, adapters if len(adapters) > 1 else [None])  # several: a line of each


def _draw(records: list[dict], png: Path, adapters: list[str | None]) -> Path | None:
    """One train loss, eval loss and lr line per adapter (None: all records, unnamed lines), and
    one line per score and adapter."""
    lines = {a: [_series(records, k, n, a) for k, n in LINES] for a in adapters}
    scores = {a: score_series(records, a) for a in adapters}
    if not any(train[0] or evals[0] for train, evals, _ in lines.values()) and not any(scores.values()):
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    ratios = [3, 2, 1] if any(scores.values()) else [3, 1]
    fig, axes = plt.subplots(
        len(ratios), 1, figsize=(8, 2 * len(ratios) + 2), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": ratios}, constrained_layout=True,
    )  # fmt: skip
    top, bottom = axes[0][0], axes[-1][0]
    for i, (adapter, (train, evals, lr)) in enumerate(lines.items()):
        tag, style = ("", "-") if adapter is None else (f"{adapter}: ", ("-", "--", ":", "-.")[i % 4])
        marker = "." if len(train[0]) < 50 else None
        for ax, (steps, values), label, color, mark in (
            (top, train, "train loss", "tab:blue", marker),
            (top, evals, "eval loss", "tab:orange", "o"),
            (bottom, lr, "learning rate", "tab:green", None),
        ):
            if steps:  # a line without points would still take a place in the legend
                ax.plot(steps, values, label=f"{tag}{label}", color=color, linestyle=style, marker=mark)
    top.set_ylabel("loss")
    title = "loss, scores and learning rate" if len(ratios) == 3 else "loss and learning rate"
    top.set_title(f"{png.parent.name or 'run'}: {title}")
    if len(ratios) == 3:
        _draw_scores(axes[1][0], scores)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step (micro-batches)")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    _save(fig, png)
    plt.close(fig)
    return png


def _draw_scores(ax, scores: dict) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Rewards and margins on the left axis; accuracies, which lie in [0, 1], on a right one."""
    right = None
    colors = iter(("tab:purple", "tab:red", "tab:brown", "tab:cyan", "tab:olive", "tab:pink", "tab:gray"))
    for i, (adapter, series) in enumerate(scores.items()):
        tag, style = ("", "-") if adapter is None else (f"{adapter}: ", ("-", "--", ":", "-.")[i % 4])
        for label, (steps, values) in series.items():
            if "accuracy" in label:
                right = right or ax.twinx()
                target = right
            else:
                target = ax
            marker = "o" if len(steps) < 50 else None
            target.plot(steps, values, label=f"{tag}{label}", color=next(colors, "black"), linestyle=style,
                        marker=marker)  # fmt: skip
    ax.set_ylabel("reward")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        right.set_ylabel("accuracy")
        right.set_ylim(-0.05, 1.05)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize="small")


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
