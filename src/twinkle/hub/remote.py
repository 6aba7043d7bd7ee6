"""Hub ids (``hf://org/name``, ``ms://org/name``, bare ``org/name``) to local snapshot folders.

The local cache is always tried first. A download is attempted only when that misses and the
environment allows the network (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` unset, the usual
switches of this ecosystem). Every failure becomes one ``UserError`` that says how to proceed
with a local path instead."""

import os
import re
from pathlib import Path

from twinkle.utils.errors import UserError

HF_PREFIX = "hf://"
MS_PREFIX = "ms://"
# Seconds to wait for the hub to answer a metadata request before giving up.
_TIMEOUT_S = 10
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_FILE_SUFFIXES = {".gguf", ".safetensors", ".bin", ".jsonl", ".json", ".csv", ".parquet", ".txt"}
_TRUE = {"1", "true", "yes", "on"}
_OFFLINE = "HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set, so no download was tried"


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` (that is not an existing path) reads as a hub id such as ``org/name``."""
    if name.startswith((HF_PREFIX, MS_PREFIX)):
        return True
    # ``Qwen/Qwen2.5-7B`` is an id, ``data.jsonl`` a (missing) file: only file extensions count.
    return bool(_REPO_ID.fullmatch(name)) and Path(name).suffix.lower() not in _FILE_SUFFIXES


def _network_allowed() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return not any(flag.strip().lower() in _TRUE for flag in flags)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:100]}" if text else type(exc).__name__


def _hf_cache_dir() -> str | None:
    # huggingface_hub reads HF_HOME once at import; read it at call time instead.
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _hf_snapshot(repo_id: str, repo_type: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise _NeedsExtra("huggingface_hub is not installed") from exc
    cache_dir = _hf_cache_dir()
    try:
        return Path(
            snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache_dir, local_files_only=True)
        )
    except Exception as local_exc:
        if not _network_allowed():
            raise _Miss(_OFFLINE) from local_exc
    try:
        path = snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache_dir, etag_timeout=_TIMEOUT_S)
    except Exception as exc:
        raise _Miss(_short(exc)) from exc
    return Path(path)


def _ms_snapshot(repo_id: str, repo_type: str) -> Path:
    try:
        from modelscope import snapshot_download
    except ImportError as exc:
        raise _NeedsExtra("modelscope is not installed") from exc
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except Exception as local_exc:
        if not _network_allowed():
            raise _Miss(_OFFLINE) from local_exc
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type))
    except Exception as exc:
        raise _Miss(_short(exc)) from exc


class _Miss(Exception):
    """Not in the local cache and not downloadable."""


class _NeedsExtra(Exception):
    """The client library for this hub is not installed."""


def snapshot(name: str, repo_type: str) -> Path:
    """Local folder of hub id ``name`` (``hf://``, ``ms://`` or bare ``org/name`` = Hugging Face).

    ``repo_type`` is ``'model'`` or ``'dataset'``; it also names the thing in error messages."""
    flag = "--model-id" if repo_type == "model" else "--dataset-id"
    example = "/path/to/model" if repo_type == "model" else "/path/to/data.jsonl"
    if name.startswith(MS_PREFIX):
        fetch, repo_id = _ms_snapshot, name.removeprefix(MS_PREFIX)
    else:
        fetch, repo_id = _hf_snapshot, name.removeprefix(HF_PREFIX)
    if not _REPO_ID.fullmatch(repo_id):
        raise UserError(f"{repo_type} id {name!r} is not a valid hub id; use org/name or a local path")
    try:
        return fetch(repo_id, repo_type)
    except _NeedsExtra as exc:
        raise UserError(
            f"{repo_type} {name!r} needs a hub client ({exc}); run `pip install twinkle[hub]` "
            f"or pass a local path with {flag} {example}"
        ) from exc
    except _Miss as exc:
        raise UserError(
            f"{repo_type} {name!r} is not in the local cache and could not be downloaded ({exc}); "
            f"pass a local {'folder' if repo_type == 'model' else 'file'} with {flag} {example}"
        ) from exc
