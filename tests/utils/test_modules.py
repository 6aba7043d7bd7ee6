"""``twinkle.utils.modules``: the kept module list follows the model's structure, and
``set_training`` leaves every flag as ``Module.train`` would."""

import torch
from torch import nn

from twinkle.utils.modules import _entry, any_training, forget, modules, set_training


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 2)))


def test_list_equals_a_walk_and_is_kept():
    model = _model()
    first = modules(model)
    assert first == list(model.modules())
    assert modules(model) == first


def test_a_registered_module_anywhere_renews_the_list():
    model = _model()
    modules(model)
    model[1].add_module("extra", nn.ReLU())  # deep inside
    assert modules(model) == list(model.modules())
    model[1].extra2 = nn.Tanh()  # an attribute assignment
    assert modules(model) == list(model.modules())
    holder = nn.ModuleDict()
    model.add_module("holder", holder)
    holder["x"] = nn.Linear(2, 2)  # a ModuleDict entry
    assert modules(model) == list(model.modules())


def test_forget_lists_again_after_a_removal():
    model = _model()
    modules(model)
    del model[1][0]
    forget(model)
    assert modules(model) == list(model.modules())


def test_set_training_matches_module_train():
    model, reference = _model(), _model()
    model[1][0].train(False)  # mixed flags to start from
    reference[1][0].train(False)
    for mode in (True, False, True):
        set_training(model, mode)
        reference.train(mode)
        assert [m.training for m in modules(model)] == [m.training for m in reference.modules()]
        assert any_training(model) is mode


def test_a_module_added_after_eval_is_seen():
    model = _model()
    set_training(model, False)
    model.add_module("late", nn.Dropout(0.5))  # new modules start in training mode
    assert any_training(model)
    set_training(model, False)
    assert not model.late.training


class _Counting(nn.Module):
    """A module whose ``train`` does more than set flags: it must be called."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.calls = 0

    def train(self, mode: bool = True):
        self.calls += 1
        return super().train(mode)


def test_an_overriding_train_is_called():
    model = nn.Sequential(_Counting())
    set_training(model, False)
    assert model[0].calls == 1 and not model[0].inner.training


def test_transformers_model_without_hub_kernels_takes_the_direct_path(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: calls.append(mode) or self)
    set_training(model, False)
    assert calls == []  # no recursive walk
    assert not any(m.training for m in model.modules())


def test_a_temporary_container_does_not_renew_the_list():
    model = _model()
    listed = modules(model)
    kept = _entry(model)
    nn.ModuleList(list(model.children()))  # what slicing a ModuleList does in a forward
    model[1:]  # noqa: B018
    assert _entry(model) is kept and modules(model) == listed


def test_a_kept_list_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = _model()
    set_training(model, False)
    modules(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
