"""What upstream's multimodal cookbooks name and Twinkle does not build yet is refused in one line
that names the capability: ``Dataset(features=)`` for image columns. Their template names are
built (``Gemma4Template`` among them), and an unknown template name lists the valid ones."""

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


def test_a_dataset_schema_for_image_columns_is_one_line():
    from twinkle.dataset import Dataset

    with pytest.raises(UserError, match=r"Dataset\(features=...\) is not supported yet: .*multimodal"):
        Dataset(features={"image": "Image"})
