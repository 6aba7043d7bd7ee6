"""``twinkle server --report-to tensorboard``: each run's ``metrics.jsonl`` records also as
TensorBoard scalars, in event files under the run's folder (``<run>/tensorboard``), one
writer per run. A record of operation ``op`` (``forward_backward``, ``forward``,
``optim_step``) gives the scalars ``<op>/<name>`` of its numbers, at the step counting that
run's records of ``op`` (carried on across a restart: the count starts from ``metrics.jsonl``)."""

import collections
import json
from pathlib import Path
from typing import Any

from twinkle.metric.sinks import TensorBoardSink, parse_report_to
from twinkle.utils.errors import UserError

SERVER_REPORT_TO = ("tensorboard",)


def parse_server_report_to(value: str | None) -> tuple[str, ...]:
    """The flag's names (``none`` or empty: none); the server writes TensorBoard only."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    other = [n for n in names if n not in ("none", *SERVER_REPORT_TO)]
    if other:
        raise UserError(
            f"--report-to {', '.join(other)}: twinkle server reports to tensorboard only "
            "(per-run event files); use --report-to tensorboard or none"
        )
    return parse_report_to(value)


class Reporter:
    """TensorBoard writers of the runs, made at a run's first record."""

    def __init__(self) -> None:
        self.sinks: dict[Path, TensorBoardSink] = {}
        self.steps: dict[Path, collections.Counter] = {}

    def log(self, folder: Path, record: dict[str, Any]) -> None:
        if folder not in self.sinks:
            self.steps[folder] = self._count(folder / "metrics.jsonl", exclude_last=True)
            self.sinks[folder] = TensorBoardSink(folder)
        op = str(record.get("op", "record"))
        self.steps[folder][op] += 1
        numbers = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("op", "time")
        }
        self.sinks[folder].log(op, self.steps[folder][op], numbers)

    @staticmethod
    def _count(path: Path, exclude_last: bool) -> collections.Counter:
        """How many records of each op ``metrics.jsonl`` holds before the one being logged."""
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        if exclude_last:
            lines = lines[:-1]
        return collections.Counter(json.loads(line).get("op", "record") for line in lines if line.strip())

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()
        self.sinks.clear()
