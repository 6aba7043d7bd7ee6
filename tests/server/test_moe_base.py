"""A Mixture-of-experts base whose config asks for the router's auxiliary loss is refused by the
service in one line: the aux's weight is fixed at each backward, while a window's reduction (a
sum or a mean of its losses) is known only at ``optim_step``."""

import json
import sys
from pathlib import Path

import pytest

from twinkle.server.core import ModelCore
from twinkle.utils.errors import UserError

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import build_qwen3_moe  # noqa: E402


def test_a_base_asking_for_the_router_aux_loss_is_one_line(tiny_model_dir, tmp_path):
    folder = build_qwen3_moe(tiny_model_dir, tmp_path / "qwen3_moe")
    core = ModelCore(str(folder), max_loras=2, max_r=8)  # the aux not asked for: serves
    assert core.model.router_aux is None
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    with pytest.raises(UserError) as info:
        ModelCore(str(folder), max_loras=2, max_r=8)
    text = str(info.value)
    assert "\n" not in text and "output_router_logits=True" in text and "config.json" in text
