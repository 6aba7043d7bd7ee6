"""A step's outputs leave their process (pickled, as Ray returns them to the driver) with the
logps an RL or preference script reads (``outputs.get('logps')`` in upstream's routing-replay
GRPO script, after ``micro_batch_size=``); a cross-entropy step, whose scripts do not read them,
pays for no head product and says so when they are read on the other side."""

import pickle

import pytest
import torch

from twinkle.model.inputs import prepare_inputs
from twinkle.utils.errors import UserError

ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Twinkle."},
        ]
    },
    {"messages": [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "Twinkle"}]},
]


def test_an_rl_step_ships_its_logps(make_model):
    model = make_model(init_lora_weights=False)
    model.set_loss("GRPOLoss", epsilon=0.2)
    logps = model.forward_only(inputs=ROWS)["logps"]
    batch = prepare_inputs(model.optimizer_group["default"], ROWS, model.tokenizer)
    old = [row[labels != -100].tolist() for row, labels in zip(logps, batch["labels"], strict=True)]
    for micro in (None, 1):
        out = model.forward_backward(
            inputs=ROWS, old_logps=old, advantages=[1.0, -1.0], micro_batch_size=micro
        )
        back = pickle.loads(pickle.dumps(out))
        assert float(back) == float(out)
        torch.testing.assert_close(back.get("logps"), logps, atol=1e-5, rtol=0)


def test_a_cross_entropy_step_leaves_them_behind(make_model):
    model = make_model()
    back = pickle.loads(pickle.dumps(model.forward_backward(inputs=ROWS, micro_batch_size=1)))
    with pytest.raises(UserError, match="the training step's logps were not kept here"):
        back.get("logps")
