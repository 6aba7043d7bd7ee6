"""The CLI's ``--max-grad-norm`` and ``--model-cls`` reach the model through the run defaults, so
the contract's ``model.clip_grad_and_step()`` (no argument) honours the flag."""

import pytest

import twinkle.model.transformers_model as facade
from twinkle.dataloader import DataLoader
from twinkle.model import TransformersModel
from twinkle.runtime import RunDefaults, set_run_defaults
from twinkle.utils.errors import UserError


def _limits_used(monkeypatch) -> list[float]:
    limits, real = [], facade.clip_gradients

    def spy(params, limit, *args):
        limits.append(limit)
        return real(params, limit, *args)

    monkeypatch.setattr(facade, "clip_gradients", spy)
    return limits


def test_clip_grad_and_step_takes_the_flag_when_the_call_gives_none(make_model, dataset, monkeypatch):
    limits = _limits_used(monkeypatch)
    model = make_model()
    batch = next(iter(DataLoader(dataset, batch_size=2, world_size=1, rank=0)))
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    set_run_defaults(RunDefaults(max_grad_norm=0.25))  # as CLI.from_args does for --max-grad-norm 0.25
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step(max_grad_norm=3.0)  # an explicit argument wins
    model.forward_backward(inputs=batch)
    model.clip_grad_norm()
    assert limits == [1.0, 0.25, 3.0, 0.25]


def test_model_cls_by_name_from_the_call_or_the_flag(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), model_cls="LlamaForCausalLM")
    assert type(model.model).__name__ == "LlamaForCausalLM"
    set_run_defaults(RunDefaults(model_cls="NoSuchModelClass"))
    with pytest.raises(UserError, match="--model-cls NoSuchModelClass: transformers has no such class"):
        TransformersModel(str(tiny_model_dir))
