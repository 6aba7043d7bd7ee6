"""``twinkle server --report-to tensorboard,wandb,swanlab``: each run's ``metrics.jsonl`` records
also go to these libraries. A record of operation ``op`` (``forward_backward``, ``forward``,
``optim_step``) gives the numbers ``<op>/<name>`` at the step counting that run's records of
``op`` (carried on across a restart: the count starts from ``metrics.jsonl``).

- ``tensorboard``: event files in the run's folder (``<run>/tensorboard``), one writer per run.
- ``wandb``: one wandb run per training run, in the run's folder (``<run>/wandb``), named by the
  run id, with the run's ``run.json`` as its config; offline (``wandb sync`` uploads it later)
  unless ``WANDB_API_KEY`` is set. Each op's numbers are plotted against the op's own count
  (``<op>/step``, a wandb step metric): wandb's own step must only grow, and a run's counts of
  ``forward_backward`` and ``optim_step`` do not grow together.
- ``swanlab``: swanlab holds one experiment per process, so the server keeps one for all its
  runs, under ``<output-dir>/swanlab``, each run's numbers under the prefix ``<run id>/``
  (``<run id>/<op>/<name>``); offline unless ``SWANLAB_API_KEY`` is set.

A library's writers are made at a run's first record and closed when the server stops."""

import collections
import json
import threading
from pathlib import Path
from typing import Any

from twinkle.metric.sinks import SwanlabSink, TensorBoardSink, WandbSink
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import refuse_link_message


class RunWandb(WandbSink):
    """One training run's wandb run: each op's numbers against the op's own count."""

    def __init__(self, folder: Path, config: dict[str, Any]):
        super().__init__(folder, config, name=folder.name, one_of_many=True)
        self.axes: set[str] = set()

    def log(self, kind: str, step: int, numbers: dict[str, float]) -> None:
        if kind not in self.axes:
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self.axes.add(kind)
        self.run.log({**{f"{kind}/{k}": v for k, v in numbers.items()}, f"{kind}/step": step})


class Reporter:
    """The ``--report-to`` writers of the server's runs (run folder -> writers) and the one
    server-wide swanlab experiment. ``log`` comes from the queue's worker, ``close`` from the
    server's shutdown: a lock orders them, and a record after ``close`` reaches ``metrics.jsonl``
    only."""

    def __init__(self, names: tuple[str, ...], output_dir: Path):
        self.names, self.output_dir = names, output_dir
        self.sinks: dict[Path, list[Any]] = {}
        self.steps: dict[Path, collections.Counter] = {}
        self.swanlab: SwanlabSink | None = None
        self.lock = threading.Lock()
        self.closed = False
        if "swanlab" in names and (output_dir / "swanlab").is_symlink():
            raise UserError(refuse_link_message(output_dir / "swanlab", "--output-dir"))

    def log(self, folder: Path, record: dict[str, Any]) -> None:
        with self.lock:
            if self.closed:
                return
            if folder not in self.sinks:
                self._open(folder)
            op = str(record.get("op", "record"))
            self.steps[folder][op] += 1
            step = self.steps[folder][op]
            numbers = {
                k: float(v)
                for k, v in record.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("op", "time")
            }
            for sink in self.sinks[folder]:
                sink.log(op, step, numbers)
            if self.swanlab is not None:
                self.swanlab.log(f"{folder.name}/{op}", step, numbers)

    def _open(self, folder: Path) -> None:
        self.steps[folder] = self._count(folder / "metrics.jsonl", exclude_last=True)
        meta = folder / "run.json"
        config = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {"id": folder.name}
        sinks: list[Any] = []
        if "tensorboard" in self.names:
            sinks.append(TensorBoardSink(folder))
        if "wandb" in self.names:
            sinks.append(RunWandb(folder, config))
        self.sinks[folder] = sinks
        if "swanlab" in self.names and self.swanlab is None:
            self.swanlab = SwanlabSink(self.output_dir, {"output_dir": str(self.output_dir)})

    @staticmethod
    def _count(path: Path, exclude_last: bool) -> collections.Counter:
        """How many records of each op ``metrics.jsonl`` holds before the one being logged."""
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        if exclude_last:
            lines = lines[:-1]
        return collections.Counter(json.loads(line).get("op", "record") for line in lines if line.strip())

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for sinks in self.sinks.values():
                for sink in sinks:
                    sink.close()
            self.sinks.clear()
            if self.swanlab is not None:
                self.swanlab.close()
                self.swanlab = None
