"""Every Twinkle name that upstream's ``cookbook/exp`` scripts import resolves; the names whose
behaviour is upstream's experiment refuse in one line when built, never when imported; and the
small utilities they need behave (``PosixFileLock`` across processes, ``NoSplitModulesPatch``)."""

import fcntl
import importlib
import multiprocessing
import pickle

import pytest
import torch

from twinkle.utils.errors import UserError

# (module, names) as the exp scripts import them
EXP_IMPORTS = [
    ("twinkle.utils.parallel", ["PosixFileLock"]),
    ("twinkle.patch.no_split_modules", ["NoSplitModulesPatch"]),
    ("twinkle.dataset.base", ["DatasetMeta"]),
    ("twinkle_agentic.protocol.openai", ["OpenAI"]),
    (
        "twinkle_agentic.preprocessor",
        [
            "QualityPreprocessor", "SamplerBackend", "IntentClassifier", "HardFilter", "RefuseFilter",
            "DeadLoopFilter", "TokenSoupFilter", "MessageSanityFilter", "SpecialCharsFilter", "ModelFilter",
            "DedupFilter", "MessageNormalizer", "FixUnicodeFilter", "RemoveRepeatSentencesFilter", "TokenNumFilter",
        ],
    ),
    ("twinkle_agentic.chunker.native", ["NativeChunker"]),
    ("twinkle_agentic.condenser", ["ModelCondenser"]),
    ("twinkle_agentic.data_format", ["Chunks"]),
    ("twinkle_agentic.reward", ["F1Reward", "CoTReward", "ToolExploreReward"]),
    ("twinkle_agentic.reward.f1", ["_f1_score", "_extract_final_answer"]),
    ("twinkle_agentic.rollout", ["APIMultiTurnRollout"]),
    ("twinkle_agentic.rollout.multi_turn", ["MultiTurnRollout"]),
    ("twinkle_agentic.rollout.multi_turn_condense", ["MultiTurnCondenseRollout"]),
    ("twinkle_agentic.tools.tool_manager", ["ToolManager"]),
    ("twinkle_agentic.tools.extract_condensed", ["ExtractCondensed"]),
]  # fmt: skip

NOT_YET = [
    ("twinkle_agentic.condenser", "ModelCondenser"),
    ("twinkle_agentic.rollout", "APIMultiTurnRollout"),
    ("twinkle_agentic.rollout.multi_turn_condense", "MultiTurnCondenseRollout"),
    ("twinkle_agentic.tools.extract_condensed", "ExtractCondensed"),
    ("twinkle_agentic.preprocessor", "IntentClassifier"),
    ("twinkle_agentic.preprocessor", "SamplerBackend"),
    ("twinkle_agentic.preprocessor", "ModelFilter"),
    ("twinkle_agentic.preprocessor", "MessageNormalizer"),
]


@pytest.mark.parametrize(("module", "names"), EXP_IMPORTS, ids=[m for m, _ in EXP_IMPORTS])
def test_the_exp_scripts_imports_resolve(module, names):
    loaded = importlib.import_module(module)
    assert [n for n in names if not hasattr(loaded, n)] == []


@pytest.mark.parametrize(("module", "name"), NOT_YET, ids=[n for _, n in NOT_YET])
def test_an_experiment_name_refuses_in_one_line_when_built(module, name):
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(UserError, match=rf"^{name} is not supported yet: ") as info:
        cls(model_id="any", chunk_size=3)
    assert "\n" not in str(info.value)


def test_dataset_base_is_the_dataset_module():
    from twinkle.dataset import Dataset, DatasetMeta, base

    assert base.DatasetMeta is DatasetMeta and base.Dataset is Dataset


def _try_lock(path, answers):
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            answers.put("free")
        except BlockingIOError:
            answers.put("held")


def _count(lock, path, times):
    for _ in range(times):
        with lock:
            with open(path) as handle:
                value = int(handle.read() or 0)
            with open(path, "w") as handle:
                handle.write(str(value + 1))


def test_posix_file_lock_excludes_other_processes(tmp_path):
    from twinkle.utils.parallel import PosixFileLock

    path = tmp_path / "sub" / "log.lock"
    lock = PosixFileLock(str(path))
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    with lock:
        with lock:  # nested in one process: released once, at the outer end
            pass
        probe = context.Process(target=_try_lock, args=(str(path), answers))
        probe.start()
        probe.join(10)
        assert answers.get(timeout=5) == "held"
    probe = context.Process(target=_try_lock, args=(str(path), answers))
    probe.start()
    probe.join(10)
    assert answers.get(timeout=5) == "free"
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()

    counter = tmp_path / "counter"
    counter.write_text("0")
    copy = pickle.loads(pickle.dumps(lock))  # what a datasets worker or a Ray actor receives
    workers = [context.Process(target=_count, args=(one, str(counter), 200)) for one in (lock, copy, lock)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert counter.read_text() == "600"  # no increment lost: the read-modify-write was exclusive
    lock.close()


class Layer(torch.nn.Module):
    pass


class Tiny(torch.nn.Module):
    _no_split_modules = ["OtherLayer"]

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])


def test_no_split_modules_patch_names_the_instances_layers_and_reverts():
    from twinkle.distributed.fsdp import apply_fsdp2  # noqa: F401 - the reader of the attribute
    from twinkle.patch import apply_context, apply_patch
    from twinkle.patch.no_split_modules import NoSplitModulesPatch

    model, other = Tiny(), Tiny()
    patch = NoSplitModulesPatch("Layer")
    assert apply_patch(model, patch) is model
    assert model._no_split_modules == {"Layer"} and other._no_split_modules == ["OtherLayer"]
    patch.unpatch(model)
    assert model._no_split_modules == ["OtherLayer"] and "_no_split_modules" not in model.__dict__
    with apply_context(model, NoSplitModulesPatch({"Layer", "Block"})):
        assert model._no_split_modules == {"Layer", "Block"}
    assert model._no_split_modules == ["OtherLayer"]
    assert NoSplitModulesPatch()(Tiny())._no_split_modules == {"Qwen3_5DecoderLayer"}  # upstream's default
    with pytest.raises(UserError, match="class names"):
        NoSplitModulesPatch([])
