"""Upstream's multimodal cookbooks' names: their template names are built (``Gemma4Template``
among them), an unknown template name lists the valid ones, and ``Dataset(features=)`` given
something other than ``datasets`` features is one line."""

import pytest

from twinkle.template import get_template
from twinkle.utils.errors import UserError


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(
        UserError, match="unknown template 'NoSuch'; valid names: Template, Qwen3_5Template"
    ) as info:
        get_template("NoSuch")
    assert "DeepseekV4Template" in str(info.value) and "Gemma4Template" in str(info.value)


def test_the_command_line_takes_upstreams_gemma4_name():
    from twinkle.cli import CLI

    assert (
        CLI.from_args(["--template-cls", "Gemma4Template"], env={}).template.template_cls == "Gemma4Template"
    )


def test_a_dataset_schema_of_text_is_one_line():
    from twinkle.dataset import Dataset

    with pytest.raises(
        UserError, match=r"Dataset\(features=...\): 'image' is the text 'Image'; give a datasets"
    ):
        Dataset(features={"image": "Image"})
