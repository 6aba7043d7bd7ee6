"""Set-up run by several processes at once never corrupts a cache.

Two processes building the same converted model at once is ``tests/hub/test_hub.py::
test_concurrent_processes_build_once``; here: a builder killed while holding the lock, and two
processes filling the one on-disk dataset cache there is (``datasets``' Arrow cache, used for
CSV and Parquet files; JSON rows and ``Dataset.map``/``encode`` stay in memory, so they have none)."""

import csv
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from twinkle.hub import ensure_converted, resolve_dataset
from twinkle.hub.cache import COMPLETE_MARKER

ROWS = [{"query": f"question {i}", "response": f"answer {i} " * (i % 7 + 1)} for i in range(2000)]


def _slow_partial_build(tmp: Path) -> None:
    (tmp / "half.bin").write_text("torn")
    time.sleep(120)  # killed in here


def _good_build(tmp: Path) -> None:
    (tmp / "payload.txt").write_text("done")


def _build(final: str, slow: bool) -> None:
    ensure_converted(Path(final), _slow_partial_build if slow else _good_build)


def test_builder_killed_while_holding_the_lock(tmp_path):
    final = tmp_path / "models" / "thing-abc"
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(target=_build, args=(str(final), True))
    victim.start()
    deadline = time.monotonic() + 60
    while not list(final.parent.glob(".thing-abc.tmp-*/half.bin")):
        assert time.monotonic() < deadline and victim.is_alive(), "the builder never started"
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)  # dies holding the lock, mid-build
    victim.join(timeout=30)
    assert not final.exists()  # the torn build is not mistaken for a finished one

    survivor = ctx.Process(target=_build, args=(str(final), False))  # flock died with its holder
    survivor.start()
    survivor.join(timeout=120)
    assert survivor.exitcode == 0
    assert (final / "payload.txt").read_text() == "done" and (final / COMPLETE_MARKER).is_file()
    assert not (final / "half.bin").exists()
    assert not list(final.parent.glob(".thing-abc.tmp-*"))  # the dead builder's leftovers are gone


def _load(path: str, cache: str, barrier, results) -> None:
    os.environ["TWINKLE_CACHE"] = cache
    barrier.wait()
    results.put(resolve_dataset(path).to_list())


@pytest.mark.slow
def test_two_processes_filling_the_dataset_cache_at_once(tmp_path, monkeypatch):
    """CSV and Parquet take the same path through ``datasets.load_dataset``; CSV stands for both."""
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["query", "response"])
        writer.writeheader()
        writer.writerows(ROWS)
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_load, args=(str(path), str(cache), barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    loaded = [results.get(timeout=180) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert loaded[0] == ROWS and loaded[1] == ROWS
    monkeypatch.setenv("TWINKLE_CACHE", str(cache))
    assert resolve_dataset(str(path)).to_list() == ROWS  # a third reader finds the cache intact
    leftovers = [p for p in cache.rglob("*") if p.name.endswith(".incomplete") or ".incomplete" in p.parts]
    assert not leftovers, leftovers
