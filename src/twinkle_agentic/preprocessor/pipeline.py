"""``QualityPreprocessor``: runs quality steps in order over a batch of rows, logs what each
step dropped, and hands the survivors back as columns (``Dataset.map`` takes it as a
``Preprocessor``)."""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinkle.preprocessor import Preprocessor
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger
from twinkle.utils.parallel import PosixFileLock
from twinkle_agentic.preprocessor.step import Rows

logger = get_logger()

Step = Callable[[Rows], tuple[Rows, Rows]]


class QualityPreprocessor(Preprocessor):
    """``QualityPreprocessor(pipeline=[HardFilter(), RefuseFilter(), ...], dropped_log_path='')``.

    Each step takes a list of rows and returns ``(kept, dropped)``. The steps run in order, each
    on what the one before kept; the log says, per batch, how many rows each step took and left.
    With ``dropped_log_path`` every dropped row is appended there as one JSON line
    ``{"step": <step name>, "row": <row>}`` under a file lock, so that the worker processes of a
    ``num_proc`` map share the file; the file is started empty when the preprocessor is built."""

    def __init__(self, pipeline: list[Step], dropped_log_path: str = "") -> None:
        self.pipeline = list(pipeline)
        bad = [step for step in self.pipeline if not callable(step)]
        if not self.pipeline or bad:
            raise UserError(
                f"QualityPreprocessor(pipeline=...): give a list of callable steps, got {pipeline!r}"
            )
        self.dropped_log_path = os.fspath(dropped_log_path) if dropped_log_path else ""
        self._lock = PosixFileLock(self.dropped_log_path + ".lock") if self.dropped_log_path else None
        if self.dropped_log_path:
            Path(self.dropped_log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.dropped_log_path).write_text("", encoding="utf-8")

    def __call__(self, rows: Any) -> dict[str, list]:  # type: ignore[override]
        columns = list(rows) if isinstance(rows, dict) else None
        current = self.map_col_to_row(rows)
        first, report = len(current), []
        for step in self.pipeline:
            if not current:
                break
            name = getattr(step, "__name__", None) or type(step).__name__
            started, before = time.perf_counter(), len(current)
            kept, dropped = step(current)
            current = self.map_col_to_row(kept)
            report.append(f"{name} {before}->{len(current)} ({time.perf_counter() - started:.3f}s)")
            self._log_dropped(name, dropped)
        logger.info(f"QualityPreprocessor: {first} -> {len(current)} rows; " + ", ".join(report))
        return self.map_row_to_col(current, keys=columns if not current else None)

    def _log_dropped(self, step: str, dropped: Rows) -> None:
        if self._lock is None or not dropped:
            return
        lines = "".join(
            json.dumps({"step": step, "row": r}, ensure_ascii=False, default=str) + "\n" for r in dropped
        )
        with self._lock, open(self.dropped_log_path, "a", encoding="utf-8") as handle:
            handle.write(lines)
