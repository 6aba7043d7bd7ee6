"""``rotate_checkpoints``: keep at most N ``checkpoint-*`` folders, never losing the ones that matter."""

import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from twinkle.checkpoint import layout
from twinkle.utils.errors import UserError

ROTATED_PREFIX = "checkpoint-"


def _metric(folder: Path) -> float:
    try:
        value = json.loads((folder / layout.TRAINER_STATE).read_text()).get("metric")
    except (OSError, ValueError):
        return math.inf
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else math.inf


def best_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-*`` folder with the lowest ``metric`` saved with it (an eval loss:
    lower is better; the newer one on a tie); None when no checkpoint has a finite metric."""
    scored = [
        (_metric(f), i, f)
        for i, f in enumerate(layout.complete_checkpoints(output_dir))
        if f.name.startswith(ROTATED_PREFIX)
    ]
    scored = [item for item in scored if math.isfinite(item[0])]
    return min(scored, key=lambda item: (item[0], -item[1]))[2] if scored else None


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int, keep: Iterable[str] = ()) -> list[Path]:
    """Delete the oldest complete ``checkpoint-*`` folders under ``output_dir`` until at most
    ``save_total_limit`` remain; returns the deleted paths.

    Never deleted: the newest complete checkpoint, the best one (``best_checkpoint``), folders
    named in ``keep``, ``last-checkpoint`` and anything not named ``checkpoint-*``, and incomplete
    folders (they are not counted either). So more than ``save_total_limit`` may remain when the
    best is not the newest. A folder is renamed to a hidden name before it is removed, so a crash
    mid-delete never leaves a half-deleted folder that still looks complete."""
    if save_total_limit < 1:
        raise UserError(f"save_total_limit must be at least 1, got {save_total_limit}")
    folders = [f for f in layout.complete_checkpoints(output_dir) if f.name.startswith(ROTATED_PREFIX)]
    if not folders:
        return []
    protected = {folders[-1].name, *keep}
    best = best_checkpoint(output_dir)
    if best is not None:
        protected.add(best.name)
    excess = len(folders) - save_total_limit
    deleted = []
    for folder in folders:
        if excess <= 0:
            break
        if folder.name in protected:
            continue
        doomed = folder.with_name(f".{folder.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(folder)
        excess -= 1
    return deleted
