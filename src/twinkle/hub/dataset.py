"""``resolve_dataset``: a dataset id to a Hugging Face ``datasets.Dataset``."""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from twinkle.hub.jsonrows import SKIP_HINT, read_json_records, type_conflicts
from twinkle.hub.remote import looks_like_hub_id, snapshot
from twinkle.utils.cache import cache_root
from twinkle.utils.errors import UserError

if TYPE_CHECKING:  # imported lazily: ``datasets`` is slow to import and resolve_model skips it
    import datasets

BUNDLED_DATASET_NAMES = frozenset(
    {"self-cognition", "twinkle://self-cognition", "swift/self-cognition", "ms://swift/self-cognition"}
)
# The bundled preference pairs (``self_cognition_dpo*.jsonl``), one file per split.
BUNDLED_PREFERENCE_NAMES = frozenset({"self-cognition-dpo", "twinkle://self-cognition-dpo"})
PREFERENCE_SPLITS = {"train": "self_cognition_dpo.jsonl", "eval": "self_cognition_dpo_eval.jsonl"}
# The bundled arithmetic word problems in GSM8K form (scripts/build_arithmetic.py), one file per
# split: one-step problems by default, the two-step level under its own name.
ARITHMETIC_LEVELS = {
    "arithmetic-gsm8k": {"train": "arithmetic_gsm8k.jsonl", "eval": "arithmetic_gsm8k_eval.jsonl"},
    "arithmetic-gsm8k-two-step": {
        "train": "arithmetic_gsm8k_two_step.jsonl",
        "eval": "arithmetic_gsm8k_two_step_eval.jsonl",
    },
}
BUNDLED_ARITHMETIC = {alias: name for name in ARITHMETIC_LEVELS for alias in (name, f"twinkle://{name}")}
BUNDLED_ARITHMETIC_NAMES = frozenset(BUNDLED_ARITHMETIC)
# File extension -> the ``datasets`` builder that reads it (JSON is read by ``jsonrows``).
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# Metadata that hub dataset snapshots carry next to the data; never rows.
_METADATA_FILES = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}
_SPLIT_WORDS = {"train", "validation", "valid", "val", "test", "dev", "eval"}


@dataclass(frozen=True)
class RowSource:
    """``count`` consecutive rows of a loaded dataset came from ``name``: a file, or the dataset
    when its files cannot be told apart (several CSV files). ``lines`` holds each row's line in a
    JSON-lines file (None elsewhere); ``numbers`` each row's number in the file when rows were
    left out (None: they are the file's rows 0, 1, ...)."""

    name: str
    count: int
    lines: tuple[int, ...] | None = None
    numbers: tuple[int, ...] | None = field(default=None)

    def where(self, record: int) -> str:
        """``<file>:<line>: row <n>``, or ``<source>: row <n>`` without lines."""
        number = self.numbers[record] if self.numbers is not None else record
        if self.lines is not None:
            return f"{self.name}:{self.lines[record]}: row {number}"
        return f"{self.name}: row {number}"


class Loaded(NamedTuple):
    """Rows as loaded, where they came from, and the rows ``skip_bad_rows`` left out (each as
    ``<where>: <what is wrong>``) of the ``read`` rows there were."""

    data: datasets.Dataset
    sources: list[RowSource]
    skipped: list[str]
    read: int


def rows_to_dataset(rows: list[dict[str, Any]]) -> datasets.Dataset:
    """A ``datasets.Dataset`` holding every key of every row, in first-seen order (``from_list``
    keeps only the first row's); a key missing from a row is null there."""
    import datasets

    columns = list(dict.fromkeys(key for row in rows for key in row))
    return datasets.Dataset.from_dict({key: [row.get(key) for row in rows] for key in columns})


def rows_with_conflicts(
    rows: list[dict[str, Any]], name: str, where: Any, skip_bad_rows: bool
) -> tuple[datasets.Dataset, list[int], list[str]]:
    """``rows`` as a dataset; when a column mixes value types (which Arrow cannot store), the
    first row that breaks it is an error naming ``where(index)`` and the field, or, with
    ``skip_bad_rows``, every such row is left out. Returns the dataset, the indices kept and
    what was left out."""
    try:
        dataset = rows_to_dataset(rows)
    except Exception as exc:
        conflicts = type_conflicts(rows)
        if not conflicts:
            reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"dataset {name}: a column mixes value types ({reason}); make rows consistent"
            ) from exc
        if not skip_bad_rows:
            index, _, text = conflicts[0]
            raise UserError(f"{where(index)}: {text}; fix the row, {SKIP_HINT}") from exc
    else:
        # Arrow stores text beside bytes as bytes without a word (a picture's path would become
        # the path's bytes); a bytes column is checked as a refused mix is
        conflicts = type_conflicts(rows) if "binary" in repr(dataset.features) else []
        if not conflicts:
            return dataset, list(range(len(rows))), []
        if not skip_bad_rows:
            index, _, text = conflicts[0]
            raise UserError(f"{where(index)}: {text}; fix the row, {SKIP_HINT}")
    bad = {index for index, _, _ in conflicts}
    kept = [i for i in range(len(rows)) if i not in bad]
    skipped = [f"{where(index)}: {text}" for index, _, text in conflicts]
    if not kept:
        return rows_to_dataset([]), kept, skipped
    try:
        return rows_to_dataset([rows[i] for i in kept]), kept, skipped
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"dataset {name}: a column mixes value types ({reason}); make rows consistent"
        ) from exc


def asset_path(name: str) -> Path:
    """A file shipped in ``twinkle/hub/assets``."""
    return Path(str(importlib.resources.files("twinkle.hub") / "assets" / name))


def bundled_dataset_path() -> Path:
    """The default training rows (``twinkle/hub/assets/self_cognition_mixed.jsonl``): the 150
    identity rows of ``identity_rows_path()`` interleaved one to one with 150 replay rows, the
    bundled model's own greedy answers to ``general_prompts.jsonl``. They were written by
    ``twinkle replay --identity-data self-cognition --max-new-tokens 64 --output ...`` and keep
    the adapter from spilling the identity into unrelated answers (docs/design-notes.md)."""
    return asset_path("self_cognition_mixed.jsonl")


def identity_rows_path() -> Path:
    """The bundled identity rows alone (``twinkle/hub/assets/self_cognition.jsonl``)."""
    return asset_path("self_cognition.jsonl")


def bundled_preference_path(split: str = "train") -> Path:
    """The bundled preference pairs (``self-cognition-dpo``): 120 training pairs (``train``)
    and 30 held-out pairs whose prompts are not trained on (``eval``), half Chinese, half
    English. Each row is ``{prompt, chosen, rejected, tag}``: the identity answer as the
    configured assistant (with ``{{NAME}}``/``{{AUTHOR}}``, filled by
    ``SelfCognitionDPOProcessor``) preferred over a wrong or generic identity. Written by
    ``scripts/build_self_cognition_dpo.py`` from the identity rows of the bundled set."""
    if split not in PREFERENCE_SPLITS:
        raise UserError(
            f"the bundled dataset self-cognition-dpo has no {split!r} split; use split "
            f"{' or '.join(repr(s) for s in PREFERENCE_SPLITS)}"
        )
    return asset_path(PREFERENCE_SPLITS[split])


def _split_words(path: Path, root: Path) -> set[str]:
    words = re.split(r"[^a-z0-9]+", str(path.relative_to(root).with_suffix("")).lower())
    return _SPLIT_WORDS.intersection(words)


def _data_files(folder: Path, name: str, subset_name: str | None, split: str) -> list[Path]:
    """Data files under ``folder`` (recursively), narrowed to ``subset_name`` and ``split``."""
    if subset_name:
        subsets = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        if subset_name not in subsets:
            raise UserError(
                f"dataset {name!r} has no subset {subset_name!r}; subsets found: {subsets or 'none'}"
            )
        folder = folder / subset_name
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FORMATS
        and p.name not in _METADATA_FILES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise UserError(f"dataset folder {name!r} holds no data files; supported: {', '.join(FORMATS)}")
    tagged = {path: _split_words(path, folder) for path in files}
    if not any(tagged.values()):
        # Files not named after splits: everything is the train split.
        if split != "train":
            raise UserError(f"dataset {name!r} has only a 'train' split (its files are not named by split)")
        return files
    chosen = [path for path, words in tagged.items() if split in words]
    if not chosen:
        found = sorted(set().union(*tagged.values()))
        raise UserError(f"dataset {name!r} has no {split!r} split; splits found: {found}")
    return chosen


def parquet_rows(path: Path) -> int:
    """The row count in a parquet file's footer; a file pyarrow cannot open (cut short, damaged,
    not parquet at all) is a ``UserError`` naming it."""
    import pyarrow.parquet

    try:
        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError or its own errors
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"dataset file {path} is not a readable parquet file ({reason}); write or download it again"
        ) from None


def _has_rows(path: Path, builder: str) -> bool:
    if builder == "parquet":
        return parquet_rows(path) > 0
    with open(path, encoding="utf-8", errors="replace") as handle:  # csv: a header and one row
        return sum(1 for line, _ in zip(handle, range(2), strict=False) if line.strip()) > 1


def _from_json_files(files: list[Path], name: str, skip_bad_rows: bool) -> Loaded:
    rows: list[dict[str, Any]] = []
    sources: list[RowSource] = []
    owner: list[tuple[int, int]] = []  # (source, row in it) of each row
    for path in files:
        records, lines = read_json_records(path)
        owner += [(len(sources), i) for i in range(len(records))]
        rows += records
        sources.append(RowSource(str(path), len(records), None if lines is None else tuple(lines)))
    if not rows:
        raise UserError(f"dataset {name!r} has no rows; add records to the file(s)")

    def where(index: int) -> str:
        source, record = owner[index]
        return sources[source].where(record)

    data, kept, skipped = rows_with_conflicts(rows, repr(name), where, skip_bad_rows)
    if skipped:  # the sources describe the rows kept
        sources = [
            _kept_of(source, [r for s, r in (owner[i] for i in kept) if s == k])
            for k, source in enumerate(sources)
        ]
    return Loaded(data, sources, skipped, len(rows))


def _kept_of(source: RowSource, records: list[int]) -> RowSource:
    lines = None if source.lines is None else tuple(source.lines[r] for r in records)
    return RowSource(source.name, len(records), lines, tuple(records))


def _tabular_sources(files: list[Path], builder: str, name: str, rows: int) -> list[RowSource]:
    """One source per file where each file's row count is known without reading it (a single
    file; parquet metadata), else the dataset as one source."""
    if len(files) == 1:
        return [RowSource(str(files[0]), rows)]
    if builder == "parquet":
        counts = [parquet_rows(path) for path in files]
        if sum(counts) == rows:
            return [RowSource(str(path), n) for path, n in zip(files, counts, strict=True)]
    return [RowSource(f"dataset {name}", rows)]


def _from_tabular_files(files: list[Path], builder: str, name: str) -> Loaded:
    """CSV and parquet rows: their columns are typed by the reader, so no row mixes types."""
    import datasets

    if not any(_has_rows(path, builder) for path in files):
        raise UserError(f"dataset {name!r} has no rows; add records to the file(s)")
    root = cache_root() / "datasets"
    try:
        data = datasets.load_dataset(
            builder,
            data_files=[str(path) for path in files],
            split="train",
            cache_dir=str(root),
            # Local files only: never let ``datasets`` reach for the network.
            download_config=datasets.DownloadConfig(local_files_only=True, cache_dir=str(root / "downloads")),
        )
    except Exception as exc:
        cause = exc.__cause__ or exc  # ``datasets`` wraps the reader's error in a generic one
        reason = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else type(cause).__name__
        raise UserError(
            f"could not read dataset {name!r} as {builder} ({reason}); fix the file(s), or write or download them again"
        ) from exc
    return Loaded(data, _tabular_sources(files, builder, name, len(data)), [], len(data))


def _load_files(files: list[Path], name: str, skip_bad_rows: bool) -> Loaded:
    builders = {FORMATS[path.suffix.lower()] for path in files}
    if len(builders) > 1:
        raise UserError(
            f"dataset {name!r} mixes file formats ({', '.join(sorted(builders))}); keep one format"
        )
    builder = builders.pop()
    if builder == "json":
        return _from_json_files(files, name, skip_bad_rows)
    return _from_tabular_files(files, builder, name)


def _load_path(path: Path, name: str, subset_name: str | None, split: str, skip_bad_rows: bool) -> Loaded:
    if path.is_dir():
        return _load_files(_data_files(path, name, subset_name, split), name, skip_bad_rows)
    if path.suffix.lower() not in FORMATS:
        raise UserError(
            f"dataset file {name!r} has an unsupported extension; supported: {', '.join(FORMATS)}"
        )
    if split != "train":
        raise UserError(f"dataset file {name!r} has only a 'train' split; use split='train'")
    return _load_files([path], name, skip_bad_rows)


def resolve_dataset(
    dataset_id: str | None, subset_name: str | None = None, split: str = "train"
) -> datasets.Dataset:
    """Load ``dataset_id`` as a ``datasets.Dataset`` without touching the network unless needed.
    (``resolve_dataset_sources`` also says which file and line each row came from.)

    - ``None``, ``'self-cognition'``, ``'twinkle://self-cognition'``, ``'swift/self-cognition'``
      or ``'ms://swift/self-cognition'``: the bundled self-cognition rows, identity rows mixed
      with replay rows (``bundled_dataset_path``). These names always mean the bundled file,
      even where a ModelScope cache holds the remote dataset.
    - ``'self-cognition-dpo'`` or ``'twinkle://self-cognition-dpo'``: the bundled preference
      pairs, ``split`` ``'train'`` or ``'eval'`` (``bundled_preference_path``).
    - ``'arithmetic-gsm8k'`` or ``'twinkle://arithmetic-gsm8k'``: the bundled arithmetic word
      problems in GSM8K form (``question``, ``answer`` ending ``#### N``), one addition or
      subtraction each, ``split`` ``'train'`` (400) or ``'eval'`` (100 held out, none asking a
      sum or difference a training problem asks); ``'arithmetic-gsm8k-two-step'`` (or with
      ``twinkle://``): two steps each on numbers below 100, the same splits.
    - a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file: its rows as the 'train' split.
    - a local folder of such files (searched recursively; ``subset_name`` picks a subfolder and
      ``split`` picks files whose names contain the split word, e.g. ``train-0000.parquet``).
    - ``hf://org/name``, ``ms://org/name`` or a bare ``org/name`` that is not a local path: the
      hub's local cache, else a download when the network is allowed; loaded as a folder.

    Raises ``UserError`` for a missing path, an unsupported file type, a malformed JSON line
    (``<file>:<line>: invalid JSON (...)``), an empty dataset, or an unavailable hub id."""
    return resolve_dataset_sources(dataset_id, subset_name, split).data


def resolve_dataset_sources(
    dataset_id: str | None, subset_name: str | None = None, split: str = "train", skip_bad_rows: bool = False
) -> Loaded:
    """``resolve_dataset``'s rows and the sources they came from, in row order. A JSON row
    whose value has another type than the other rows' in the same field (``"query": 42`` among
    text) is an error naming its file, line and field; with ``skip_bad_rows`` it is left out and
    listed in ``skipped``."""
    if dataset_id is None or dataset_id in BUNDLED_DATASET_NAMES:
        path = bundled_dataset_path()
        if not path.is_file():
            raise UserError(f"the bundled self-cognition dataset is missing at {path}; reinstall twinkle")
        return _load_path(path, "self-cognition", None, split, skip_bad_rows)
    if dataset_id in BUNDLED_PREFERENCE_NAMES:
        path = bundled_preference_path(split)
        if not path.is_file():
            raise UserError(f"the bundled self-cognition-dpo dataset is missing at {path}; reinstall twinkle")
        return _load_path(path, "self-cognition-dpo", None, "train", skip_bad_rows)
    if dataset_id in BUNDLED_ARITHMETIC_NAMES:
        name = BUNDLED_ARITHMETIC[dataset_id]
        if split not in ARITHMETIC_LEVELS[name]:
            raise UserError(f"the bundled dataset {name} has no {split!r} split; use split 'train' or 'eval'")
        return _load_path(asset_path(ARITHMETIC_LEVELS[name][split]), name, None, "train", skip_bad_rows)
    path = Path(dataset_id).expanduser()
    if path.exists():
        return _load_path(path.resolve(), dataset_id, subset_name, split, skip_bad_rows)
    if looks_like_hub_id(dataset_id):
        return _load_path(snapshot(dataset_id, "dataset"), dataset_id, subset_name, split, skip_bad_rows)
    raise UserError(
        f"dataset path {dataset_id!r} does not exist; pass an existing file or folder, or hf://org/name"
    )
