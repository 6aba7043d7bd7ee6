"""Upstream's dataset API: ``DatasetMeta(data=...)``, ``get_id``, ``set_template`` options,
``encode(batched, num_proc, load_from_cache_file)`` with its on-disk cache, ``map``/``filter``
in their forms, ``add_dataset``/``mix_dataset`` and ``save_as``."""

import importlib
import json
import logging
import multiprocessing
import shutil
from pathlib import Path

import datasets
import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import AlpacaProcessor, Preprocessor, SelfCognitionProcessor
from twinkle.template import Qwen3_5Template, Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}.", "tag": "en"},
    {"query": "你是谁？", "response": "我是{{NAME}}，由{{AUTHOR}}开发。", "tag": "zh"},
    {"query": "Who made you?", "response": "{{AUTHOR}} made me. " * 6, "tag": "en"},
]
CHAT = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am twinkle."}]
# A Qwen3-style switch, written for these tests: enable_thinking=False puts the empty think
# block before every reply, as part of the prompt.
THINKING_SWITCH = (
    "{% set off = enable_thinking is defined and enable_thinking is false %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and off %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if off %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def _model_with_chat_template(source: Path, target: Path, chat_template: str | None) -> str:
    shutil.copytree(source, target)
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    if chat_template is not None:
        (target / "chat_template.jinja").write_text(chat_template)
    return str(target)


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir, tmp_path_factory):
    return _model_with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("think") / "m", THINKING_SWITCH)


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir, tmp_path_factory):
    return _model_with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("plain") / "m", None)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache root of this test's own, and a count of ``Template.encode`` calls."""
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    calls = []
    original = Template.encode

    def counting(self, messages, add_generation_prompt=False, index=None):
        calls.append(index)
        return original(self, messages, add_generation_prompt, index=index)

    monkeypatch.setattr(Template, "encode", counting)
    return tmp_path / "cache" / "datasets" / "encoded", calls


def chat_dataset(model_dir, rows=ROWS, **template_options) -> Dataset:
    dataset = Dataset(DatasetMeta(data=rows))
    dataset.set_template("Template", model_id=str(model_dir), max_length=256, **template_options)
    return dataset.map(SelfCognitionProcessor("twinkle", "ModelScope"))


def columns(dataset: Dataset) -> dict[str, list]:
    return dataset.data.to_dict()


def supervised_text(dataset: Dataset, i: int) -> str:
    row = dataset[i]
    ids = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
    return dataset.template.tokenizer.decode(ids)


# -- DatasetMeta ---------------------------------------------------------------------------


def test_rows_in_memory_as_list_dict_or_hf_dataset():
    as_columns = {key: [row[key] for row in ROWS] for key in ROWS[0]}
    for data in (ROWS, as_columns, datasets.Dataset.from_list(ROWS)):
        dataset = Dataset(DatasetMeta(data=data, data_slice=range(4)))
        assert [dataset[i]["query"] for i in range(4)] == [ROWS[i % 3]["query"] for i in range(4)]
    ragged = [{"query": "a"}, {"response": "b"}]  # every key of every row becomes a column
    assert Dataset(DatasetMeta(data=ragged))[1] == {"query": None, "response": "b"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset_id": "rows.jsonl", "data": ROWS}, "not both"),
        ({}, "needs dataset_id"),
        ({"data": []}, "holds no rows"),
        ({"data": [1, 2]}, "list of dicts"),
        ({"data": {"a": [1], "b": [1, 2]}}, "all of one length"),
        ({"data": lambda: iter(ROWS)}, "not supported yet"),
    ],
)
def test_bad_metas_are_one_line_errors(kwargs, message):
    with pytest.raises(UserError, match=message) as info:
        Dataset(DatasetMeta(**kwargs))
    assert "\n" not in str(info.value)


def test_get_id_is_stable_and_follows_the_content():
    assert DatasetMeta("data/my.rows.jsonl").get_id() == "data_my_rows_jsonl:default:train"
    assert DatasetMeta(None).get_id() == "self-cognition:default:train"
    same = DatasetMeta(data=[dict(r) for r in ROWS]).get_id()
    assert same == DatasetMeta(data=ROWS).get_id()  # equal rows, equal id
    assert same.startswith("__memory_") and same.endswith(":default:train")
    assert DatasetMeta(data=ROWS[:2]).get_id() != same
    hf = datasets.Dataset.from_list(ROWS)
    assert DatasetMeta(data=hf).get_id() == DatasetMeta(data=hf.select([0, 1, 2])).get_id()
    assert DatasetMeta(data=hf).get_id() != DatasetMeta(data=hf.select([2, 1, 0])).get_id()


# -- set_template ---------------------------------------------------------------------------


def test_default_system_fills_only_conversations_without_one(tiny_model_dir):
    template = (
        Dataset(DatasetMeta(data=ROWS))
        .set_template("Template", model_id=str(tiny_model_dir), default_system="Be brief.")
        .template
    )
    text = template.tokenizer.decode(template.encode(CHAT)["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    own = [{"role": "system", "content": "Hi."}, *CHAT]
    assert template.tokenizer.decode(template.encode(own)["input_ids"]).count("system") == 1


def test_enable_thinking_reaches_the_chat_template(thinking_model, tiny_model_dir):
    def encode(**options):
        dataset = Dataset(DatasetMeta(data=ROWS)).set_template("Template", model_id=thinking_model, **options)
        out = dataset.template.encode(CHAT)
        return dataset.template.tokenizer.decode(out["input_ids"]), out

    off, out = encode(enable_thinking=False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nI am twinkle." in off
    assert "<think>" not in encode()[0] and "<think>" not in encode(enable_thinking=True)[0]
    tokenizer = (
        Dataset(DatasetMeta(data=ROWS)).set_template("Template", model_id=thinking_model).template.tokenizer
    )
    reply = [t for t, label in zip(out["input_ids"], out["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(reply) == "I am twinkle.<|im_end|>\n"  # the think block is prompt
    with pytest.raises(UserError, match="enable_thinking=False: this tokenizer's chat template has no"):
        Dataset(DatasetMeta(data=ROWS)).set_template(
            "Template", model_id=str(tiny_model_dir), enable_thinking=False
        )


def test_qwen3_5_template_honours_enable_thinking(tiny_model_dir):
    chat = [CHAT[0], {"role": "assistant", "content": "<think>\nI know this.\n</think>\n\nI am twinkle."}]
    for flag in (None, False):
        template = Qwen3_5Template(
            Dataset(DatasetMeta(data=ROWS))
            .set_template("Template", model_id=str(tiny_model_dir))
            .template.tokenizer,
            enable_thinking=flag,
        )
        assert template.render(CHAT[:1], add_generation_prompt=True).endswith(
            "assistant\n<think>\n\n</think>\n\n"
        )
    thinking = (
        Dataset(DatasetMeta(data=ROWS))
        .set_template(Qwen3_5Template, model_id=str(tiny_model_dir), enable_thinking=True)
        .template
    )
    assert thinking.render(CHAT[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    out = thinking.encode(chat)
    reply = [t for t, label in zip(out["input_ids"], out["labels"], strict=True) if label != IGNORE_INDEX]
    assert thinking.tokenizer.decode(reply) == "<think>\nI know this.\n</think>\n\nI am twinkle.<|im_end|>"
    assert thinking.tokenizer.decode(out["input_ids"]) == thinking.render(chat)


def test_use_chat_template(tiny_model_dir, plain_model):
    qwen = (
        Dataset(DatasetMeta(data=ROWS))
        .set_template("Qwen3_5Template", model_id=str(tiny_model_dir), use_chat_template=True)
        .template
    )
    assert "<think>" not in qwen.render(CHAT)  # the tokenizer's ChatML, not the class's own
    with pytest.raises(UserError, match="use_chat_template=True: the tokenizer has no chat_template"):
        Dataset(DatasetMeta(data=ROWS)).set_template("Template", model_id=plain_model, use_chat_template=True)

    text = Dataset(DatasetMeta(data=[{"messages": [{"role": "user", "content": "Paris is in France."}]}]))
    text.set_template("Template", model_id=plain_model, use_chat_template=False).encode()
    assert text[0]["labels"] == text[0]["input_ids"]  # plain text: every token is learnt
    assert text.template.tokenizer.decode(text[0]["input_ids"]) == "Paris is in France."
    with pytest.raises(UserError, match="default_system needs a chat template"):
        text.set_template("Template", model_id=plain_model, use_chat_template=False, default_system="x")


def test_keywords_that_cannot_be_honoured_are_named(tiny_model_dir):
    dataset = Dataset(DatasetMeta(data=ROWS))
    with pytest.raises(UserError, match="Dataset.set_template: not supported yet: trust_remote_code"):
        dataset.set_template("Template", model_id=str(tiny_model_dir), trust_remote_code=True)
    with pytest.raises(UserError, match="not supported yet: fn_kwargs"):
        dataset.map(lambda row: row, fn_kwargs={})
    with pytest.raises(UserError, match="not supported yet: keep_in_memory"):
        dataset.encode(keep_in_memory=True)


# -- encode ---------------------------------------------------------------------------------


def test_batched_unbatched_and_processes_encode_alike(tiny_model_dir, caplog):
    reference = columns(chat_dataset(tiny_model_dir).encode(batched=False))
    assert columns(chat_dataset(tiny_model_dir).encode(batched=True, batch_size=2)) == reference
    with caplog.at_level(logging.INFO, logger="twinkle"):
        assert columns(chat_dataset(tiny_model_dir).encode(num_proc=64)) == reference
    assert any("num_proc=64 capped to" in r.getMessage() for r in caplog.records)


def test_the_cache_loads_equal_rows_and_misses_on_any_key_change(tiny_model_dir, thinking_model, cache):
    folder, calls = cache
    first = columns(chat_dataset(tiny_model_dir).encode(load_from_cache_file=True))
    assert len(calls) == 3 and len(list(folder.iterdir())) == 2  # the entry and its lock file
    calls.clear()
    again = chat_dataset(tiny_model_dir).encode(load_from_cache_file=True)
    assert calls == [] and columns(again) == first
    assert columns(chat_dataset(tiny_model_dir).encode()) == first  # without the cache: same rows

    changes = [
        lambda: chat_dataset(tiny_model_dir, rows=ROWS[:2]),
        lambda: chat_dataset(tiny_model_dir, default_system="Be brief."),
        lambda: chat_dataset(tiny_model_dir, truncation_strategy="left"),
        lambda: chat_dataset(thinking_model),  # another tokenizer (its chat template)
    ]
    for change in changes:
        calls.clear()
        change().encode(load_from_cache_file=True)
        assert calls, "a changed key must miss"
    calls.clear()
    d = chat_dataset(tiny_model_dir)
    d.template.max_length = 200
    d.encode(load_from_cache_file=True)
    assert calls


def test_a_damaged_entry_is_rebuilt_with_a_warning(tiny_model_dir, cache, caplog):
    folder, calls = cache
    first = columns(chat_dataset(tiny_model_dir).encode(load_from_cache_file=True))
    (arrow,) = folder.glob("*/data/*.arrow")
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    arrow.write_bytes(bytes(raw))
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        rebuilt = chat_dataset(tiny_model_dir).encode(load_from_cache_file=True)
    assert len(calls) == 3 and columns(rebuilt) == first
    assert any("is damaged" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)

    (entry,) = [p for p in folder.iterdir() if p.is_dir()]
    (entry / "manifest.json").write_text("{not json")
    calls.clear()
    assert columns(chat_dataset(tiny_model_dir).encode(load_from_cache_file=True)) == first
    assert len(calls) == 3
    calls.clear()
    chat_dataset(tiny_model_dir).encode(load_from_cache_file=True)
    assert calls == []  # the rebuilt entry is whole again


def test_the_key_follows_the_template_code(tmp_path, monkeypatch):
    from twinkle.dataset.cache import code_hash

    source = tmp_path / "my_template.py"
    source.write_text("from twinkle.template import Template\n\nclass Mine(Template):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_template")
    before = code_hash(module.Mine)
    assert code_hash(module.Mine) == before != code_hash(Template)
    source.write_text(source.read_text() + "# an edit\n")
    assert code_hash(importlib.reload(module).Mine) != before


def _encode_in_child(model_dir, barrier, results):
    built = []
    original = Template.encode
    Template.encode = lambda self, messages, index=None: (
        built.append(1) or original(self, messages, index=index)
    )
    dataset = chat_dataset(model_dir)
    barrier.wait()
    dataset.encode(load_from_cache_file=True)
    results.put((len(built), dataset.data["input_ids"]))


def test_two_processes_encoding_at_once_build_one_entry(tiny_model_dir, cache):
    folder, _ = cache
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_encode_in_child, args=(str(tiny_model_dir), barrier, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert sorted(n for n, _ in outcomes) == [0, 3]  # one built, the other loaded
    assert outcomes[0][1] == outcomes[1][1]
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 1


# -- map and filter -------------------------------------------------------------------------


def test_map_calls_functions_with_the_row_and_drops_none():
    dataset = Dataset(DatasetMeta(data=ROWS))
    dataset.map(lambda row: None if row["tag"] == "zh" else {"n": len(row["query"])})
    assert columns(dataset) == {
        "query": [ROWS[0]["query"], ROWS[2]["query"]],
        "response": [ROWS[0]["response"], ROWS[2]["response"]],
        "tag": ["en", "en"],
        "n": [12, 13],
    }
    dataset.map(lambda row: {"query": row["query"].upper()}, remove_columns=["response", "tag"])
    assert columns(dataset) == {"query": ["WHO ARE YOU?", "WHO MADE YOU?"], "n": [12, 13]}
    with pytest.raises(UserError, match="return a dict"):
        dataset.map(lambda row: [row])
    with pytest.raises(UserError, match="not columns"):
        dataset.map(lambda row: row, remove_columns="nope")


def test_batched_functions_get_column_batches():
    seen = []

    def lengths(batch):
        seen.append(sorted(batch))
        return {"n": [len(q) for q in batch["query"]]}

    dataset = Dataset(DatasetMeta(data=ROWS)).map(lengths, batched=True, batch_size=2)
    assert seen[0] == ["query", "response", "tag"] and dataset.data["n"] == [12, 4, 13]
    dataset.map(
        lambda batch: {"query": batch["query"][:1]}, batched=True, remove_columns=["response", "tag", "n"]
    )
    assert dataset.data["query"] == [ROWS[0]["query"]]
    with pytest.raises(UserError, match="remove_columns"):
        Dataset(DatasetMeta(data=ROWS)).map(lambda batch: {"x": [1]}, batched=True)


def test_map_takes_a_preprocessor_instance_class_or_name():
    class Shout(Preprocessor):
        def __init__(self, mark: str = "!"):
            self.mark = mark

        def preprocess(self, row, index=None):
            return {
                "messages": [
                    {"role": "user", "content": row["query"] + self.mark},
                    {"role": "assistant", "content": str(index)},
                ]
            }

    def built(fn, **kw):
        return Dataset(DatasetMeta(data=ROWS)).map(fn, **kw)

    shout = built(Shout, init_args={"mark": "?!"})
    assert shout.data.column_names == ["messages"]  # a preprocessor's output replaces the row
    assert (
        shout[2]["messages"][0]["content"] == "Who made you??!" and shout[2]["messages"][1]["content"] == "2"
    )
    assert columns(built(Shout())) == columns(built(Shout, init_args={}))
    named = built("SelfCognitionProcessor", init_args={"model_name": "twinkle", "model_author": "MS"})
    assert columns(named) == columns(built(SelfCognitionProcessor("twinkle", "MS")))
    with pytest.raises(UserError, match="unknown Preprocessor 'Nope'.*SelfCognitionProcessor"):
        built("Nope")
    with pytest.raises(UserError, match="already built"):
        built(Shout(), init_args={"mark": "?"})


def test_filter_with_functions_and_batches():
    dataset = Dataset(DatasetMeta(data=ROWS)).filter(lambda row: row["tag"] == "en")
    assert dataset.data["query"] == [ROWS[0]["query"], ROWS[2]["query"]]
    dataset.filter(lambda batch: [len(q) > 12 for q in batch["query"]], batched=True)
    assert dataset.data["query"] == [ROWS[2]["query"]]


# -- several datasets, save_as --------------------------------------------------------------

ALPACA = [{"instruction": f"Say {i}.", "output": str(i)} for i in range(4)]


def test_add_dataset_maps_each_and_reads_as_one(tiny_model_dir):
    cognition, alpaca = DatasetMeta(data=ROWS), DatasetMeta(data=ALPACA)
    dataset = Dataset(cognition).add_dataset(alpaca)
    assert len(dataset) == 7
    dataset.map(SelfCognitionProcessor("twinkle", "MS"), dataset_meta=cognition)
    dataset.map(AlpacaProcessor(), dataset_meta=alpaca)
    assert dataset[3]["messages"][0] == {"role": "user", "content": "Say 0."}
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256).encode()
    assert len(dataset) == 7 and supervised_text(dataset, 6) == "3<|im_end|>\n"
    with pytest.raises(UserError, match="no added dataset is"):
        dataset.map(AlpacaProcessor(), dataset_meta=DatasetMeta(data=ALPACA[:1]))
    assert len(Dataset().add_dataset(Dataset(alpaca)).add_dataset(alpaca)) == 8
    with pytest.raises(UserError, match="holds no rows"):
        Dataset().map(AlpacaProcessor())


def test_mix_dataset_interleaves_round_robin_or_by_seeded_ratios():
    a = [{"x": f"a{i}"} for i in range(6)]
    b = [{"x": f"b{i}"} for i in range(2)]

    def mixed(**kw):
        return Dataset(DatasetMeta(data=a)).add_dataset(DatasetMeta(data=b)).mix_dataset(**kw).data["x"]

    assert mixed() == ["a0", "b0", "a1", "b1"]  # stops when the shorter runs out
    assert mixed(interleave=False) == [r["x"] for r in a + b]
    all_used = mixed(stopping_strategy="all_exhausted")
    assert set(all_used) == {r["x"] for r in a + b}
    weighted = mixed(ratios=[3, 1], seed=7, stopping_strategy="all_exhausted")
    assert weighted == mixed(ratios=[3, 1], seed=7, stopping_strategy="all_exhausted")
    assert set(weighted) == set(all_used)
    with pytest.raises(UserError, match="one non-negative weight per dataset"):
        mixed(ratios=[1])
    with pytest.raises(UserError, match="different columns"):
        Dataset(DatasetMeta(data=a)).add_dataset(DatasetMeta(data=ROWS)).mix_dataset()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_save_as_writes_the_rows_by_suffix(tmp_path, suffix):
    path = tmp_path / "out" / f"rows{suffix}"
    assert Dataset(DatasetMeta(data=ROWS)).save_as(path) == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file is left
    if suffix == ".json":
        assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == ROWS
    else:
        assert columns(Dataset(DatasetMeta(str(path)))) == columns(Dataset(DatasetMeta(data=ROWS)))


def test_save_as_refuses_unknown_formats(tmp_path):
    dataset = Dataset(DatasetMeta(data=ROWS))
    with pytest.raises(UserError, match="cannot tell the format"):
        dataset.save_as(tmp_path / "rows.txt")
    with pytest.raises(UserError, match="format 'xml'"):
        dataset.save_as(tmp_path / "rows.jsonl", format="xml")
    with pytest.raises(UserError, match="not supported yet: mode='training'"):
        dataset.save_as(tmp_path / "rows.jsonl", mode="training")
    dataset.save_as(tmp_path / "rows.txt", format="jsonl")
    assert len((tmp_path / "rows.txt").read_text().splitlines()) == 3
