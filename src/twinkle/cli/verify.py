"""``twinkle verify CKPT [CKPT ...]``: check checkpoint folders against their completion markers.

Each argument is a checkpoint folder or an output dir (then every checkpoint directly under it,
hidden in-progress folders left out). One line per checkpoint: ``ok``, or what is damaged,
missing or incomplete, or which file is not data: a ``trainer_state.json`` whose fields are not
what a save writes, a ``.pt`` file that holds more than tensors and plain values (found by
loading it as data, ``weights_only=True``: nothing in it runs). The exit status is 0 only when
every checkpoint passes. The checksums detect damage, not tampering: anyone can recompute them."""

from pathlib import Path

from twinkle.checkpoint import check_checkpoint, complete_checkpoints, is_complete
from twinkle.checkpoint.layout import TRAINER_STATE, parse_trainer_state
from twinkle.checkpoint.load import data_problem
from twinkle.utils.errors import UserError


def _is_checkpoint(folder: Path) -> bool:
    return is_complete(folder) or (folder / TRAINER_STATE).is_file()


def _checkpoints_in(path: Path) -> list[Path]:
    """``path`` itself when it is a checkpoint, else the checkpoints under it: the complete ones
    oldest first, then the others (incomplete, or an invalid trainer state) by name."""
    if _is_checkpoint(path):
        return [path]
    complete = complete_checkpoints(path)
    torn = sorted(
        p
        for p in path.iterdir()
        if p.is_dir() and not p.name.startswith(".") and _is_checkpoint(p) and p not in complete
    )
    return [*complete, *torn]


def _not_data(folder: Path) -> str | None:
    """The first file of ``folder`` that does not read as what a save writes, and why."""
    if (folder / TRAINER_STATE).is_file():
        try:
            parse_trainer_state(folder)
        except UserError as exc:
            return str(exc).removeprefix(f"{folder}/")
    for path in sorted(folder.rglob("*.pt")):
        problem = data_problem(path)
        if problem:
            return f"{path.relative_to(folder)} {problem}"
    return None


def _verdict(folder: Path) -> tuple[bool, str]:
    if not is_complete(folder):
        return False, "incomplete (no .twinkle-complete: its save was interrupted)"
    report = check_checkpoint(folder)
    if not report.ok:
        return False, report.describe()
    problem = _not_data(folder)
    if problem:
        return False, problem
    if not report.verified:
        return True, "ok, unverified (saved without checksums: only its completion marker was checked)"
    return True, f"ok ({report.files} files, {report.size / 2**20:.1f} MiB)"


def verify_paths(paths: list[str]) -> int:
    """Print one line per checkpoint found under ``paths``; 0 when all pass, else 1."""
    passed = True
    for arg in paths:
        path = Path(arg).expanduser()
        if not path.is_dir():
            print(f"{arg}: {'not a folder' if path.exists() else 'does not exist'}", flush=True)
            passed = False
            continue
        found = _checkpoints_in(path)
        if not found:
            print(f"{arg}: no checkpoint in this folder", flush=True)
            passed = False
        for folder in found:
            ok, text = _verdict(folder)
            passed &= ok
            print(f"{folder}: {text}", flush=True)
    return 0 if passed else 1
