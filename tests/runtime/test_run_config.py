"""The run configuration reaches the components built after ``initialize()``: the CLI's
``--max-grad-norm`` and ``--model-cls`` through the handed-over command line, and the same values
through ``initialize(run=...)`` in a script that parses none."""

import pytest

import twinkle
import twinkle.model.optimizer_step as facade
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.model import TransformersModel
from twinkle.runtime import RunDefaults
from twinkle.utils.errors import UserError


def _limits_used(monkeypatch) -> list[float]:
    limits, real = [], facade.clip_gradients

    def spy(params, limit, *args):
        limits.append(limit)
        return real(params, limit, *args)

    monkeypatch.setattr(facade, "clip_gradients", spy)
    return limits


def _four_steps(model, dataset) -> None:
    batch = next(iter(DataLoader(dataset, batch_size=2, world_size=1, rank=0)))
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step(max_grad_norm=3.0)  # an explicit argument wins
    model.forward_backward(inputs=batch)
    model.clip_grad_norm()


def test_clip_grad_and_step_takes_the_flag_when_the_call_gives_none(make_model, dataset, monkeypatch):
    limits = _limits_used(monkeypatch)
    CLI.from_args(["--max-grad-norm", "0.25"], env={})
    twinkle.initialize()
    _four_steps(make_model(), dataset)
    twinkle.initialize(run=RunDefaults(max_grad_norm=0.5))  # a script without a command line
    _four_steps(make_model(), dataset)
    twinkle.initialize()  # nothing handed over: the library default
    _four_steps(make_model(), dataset)
    assert limits == [0.25, 3.0, 0.25, 0.5, 3.0, 0.5, 1.0, 3.0, 1.0]


def test_a_model_keeps_the_configuration_it_was_built_with(make_model, dataset, monkeypatch):
    limits = _limits_used(monkeypatch)
    twinkle.initialize(run=RunDefaults(max_grad_norm=0.25))
    model = make_model()
    twinkle.initialize(run=RunDefaults(max_grad_norm=0.5))
    _four_steps(model, dataset)
    assert limits == [0.25, 3.0, 0.25]


def test_model_cls_by_name_from_the_call_or_the_flag(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), model_cls="LlamaForCausalLM")
    assert type(model.model).__name__ == "LlamaForCausalLM"
    twinkle.initialize(run=RunDefaults(model_cls="NoSuchModelClass"))  # the parser refuses it earlier
    with pytest.raises(UserError, match="--model-cls NoSuchModelClass: transformers has no such class"):
        TransformersModel(str(tiny_model_dir))
