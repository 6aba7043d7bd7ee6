"""The on-disk cache of encoded rows, keyed by everything that decides their tokens.

An entry is ``<cache_root>/datasets/encoded/<key hash>/`` holding the rows (``datasets``'
``save_to_disk`` layout under ``data/``) and ``manifest.json`` (the full key, row count and a
checksum of every file). Entries are built under an inter-process lock and renamed into place
when complete, so concurrent processes encoding the same rows build it once and the others load
it. An entry that fails its checks (a torn or edited file) is rebuilt with a warning."""

import contextlib
import importlib.metadata
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import xxhash

from twinkle.dataset.hashing import rows_hash, value_hash
from twinkle.utils.cache import cache_root
from twinkle.utils.fileio import COMPLETE_MARKER, atomic_dir, file_lock, is_complete
from twinkle.utils.logger import get_logger

logger = get_logger()
# Bump when the layout of an entry or the encoded columns change.
LAYOUT_VERSION = 1
MANIFEST = "manifest.json"

Built = tuple[datasets.Dataset, dict[str, Any]]  # the encoded rows and what to report about them


def _package_version() -> str:
    try:
        return importlib.metadata.version("twinkle")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def code_hash(template_cls: type, *modules: str) -> str:
    """Hash of the source files that turn a row into tokens: the template class and its bases
    (a user's subclass included), the whole ``twinkle.template`` package (helpers the classes
    call), and ``modules`` (the encode step), so an edit to any of them misses the cache."""
    import twinkle.template

    files = {inspect.getsourcefile(cls) for cls in template_cls.__mro__ if cls is not object}
    files |= {str(p) for p in Path(twinkle.template.__file__).parent.glob("*.py")}
    files |= {inspect.getsourcefile(sys.modules[name]) for name in modules}
    hasher = xxhash.xxh3_128()
    for path in sorted(f for f in files if f):
        hasher.update(Path(path).read_bytes())
    return hasher.hexdigest()


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """Name, class, and a hash of the vocabulary, merges, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "name": str(getattr(tokenizer, "name_or_path", "")),
        "class": type(tokenizer).__name__,
        "content": value_hash(
            [body, getattr(tokenizer, "chat_template", None), tokenizer.special_tokens_map]
        ),
    }


def encode_key(rows: datasets.Dataset, template: Any, *modules: str) -> dict[str, Any]:
    return {
        "layout": LAYOUT_VERSION,
        "twinkle": _package_version(),
        "code": code_hash(type(template), *modules),
        "rows": rows_hash(rows),
        "template": template.settings(),
        "tokenizer": tokenizer_identity(template.tokenizer),
    }


def _file_hash(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 23):
            hasher.update(chunk)
    return hasher.hexdigest()


def _checksums(folder: Path) -> dict[str, list]:
    return {
        str(p.relative_to(folder)): [p.stat().st_size, _file_hash(p)]
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class EncodeCache:
    """One entry of the cache, for one key."""

    def __init__(self, key: dict[str, Any]):
        self.key = key
        digest = value_hash(key)[:24]
        self.folder = cache_root() / "datasets" / "encoded" / digest
        self.lock = self.folder.parent / f".{digest}.lock"

    def get_or_build(self, build: Callable[[], Built]) -> Built:
        """The cached rows, or ``build()``'s, stored for next time. One process builds; others
        wanting the same entry wait for it and load it."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(file_lock(self.lock))
            except OSError as exc:  # an unwritable cache folder: encode without it
                logger.warning(f"cannot use the encode cache at {self.folder} ({exc}); encoding without it")
                return build()
            found = self._load()
            if found is not None:
                return found
            data, info = build()
            try:
                self._store(data, info)
            except OSError as exc:  # a full disk, say: the rows are good, only not kept
                logger.warning(f"could not store encoded rows in the cache at {self.folder} ({exc})")
            return data, info

    def _check(self) -> tuple[dict[str, Any], datasets.Dataset]:
        """The entry's manifest and rows; raises (any exception) when the entry is not intact."""
        if not is_complete(self.folder):
            raise ValueError("it was never finished")
        manifest = json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("key") != self.key:
            raise ValueError("its manifest names another key")
        found, expected = _checksums(self.folder / "data"), manifest.get("files", {})
        for name in sorted(set(found) | set(expected)):
            if found.get(name) != expected.get(name):
                raise ValueError(f"file data/{name} is missing, extra or differs from its checksum")
        data = datasets.load_from_disk(str(self.folder / "data"))
        if len(data) != manifest.get("num_rows"):
            raise ValueError(f"it holds {len(data)} rows, not {manifest.get('num_rows')}")
        return manifest, data

    def _load(self) -> Built | None:
        if not self.folder.exists():
            return None
        try:
            manifest, data = self._check()
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            logger.warning(f"encode cache entry {self.folder} is damaged ({reason}); encoding again")
            return None
        logger.info(f"encoded rows loaded from the cache ({self.folder})")
        return data, manifest.get("info", {})

    def _store(self, data: datasets.Dataset, info: dict[str, Any]) -> None:
        with atomic_dir(self.folder) as tmp:
            data.save_to_disk(str(tmp / "data"))
            manifest = {
                "key": self.key,
                "num_rows": len(data),
                "info": info,
                "files": _checksums(tmp / "data"),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
            (tmp / COMPLETE_MARKER).write_text("", encoding="utf-8")
        logger.info(f"encoded rows stored in the cache ({self.folder})")
