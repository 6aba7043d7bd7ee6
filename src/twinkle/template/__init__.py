"""Templates turn chat messages into ``input_ids``/``labels`` for one tokenizer.

Public names: ``Template``, ``Qwen3_5Template``, ``Qwen2_5VLTemplate`` and ``Qwen3VLTemplate``,
``Gemma3Template`` and ``Gemma4Template`` (images in messages, encoded as the model's own processor encodes them), ``DeepseekV4Template``
(DeepSeek-V4's chat format: chat and thinking modes, DSML tool calls), ``TEMPLATES``,
``get_template``, ``TRUNCATION_STRATEGIES``."""

from twinkle.template.base import TRUNCATION_STRATEGIES, Template
from twinkle.template.deepseek_v4 import DeepseekV4Template
from twinkle.template.gemma import Gemma3Template, Gemma4Template
from twinkle.template.qwen import Qwen3_5Template
from twinkle.template.qwen3_vl import Qwen3VLTemplate
from twinkle.template.registry import TEMPLATES, get_template
from twinkle.template.vision import Qwen2_5VLTemplate

__all__ = [
    "Template",
    "Qwen3_5Template",
    "Qwen2_5VLTemplate",
    "Qwen3VLTemplate",
    "Gemma3Template",
    "Gemma4Template",
    "DeepseekV4Template",
    "TEMPLATES",
    "get_template",
    "TRUNCATION_STRATEGIES",
]
