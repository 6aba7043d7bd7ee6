"""What upstream's multimodal cookbooks name and Twinkle does not build yet is refused in one line
that names the capability: their template names other than Qwen2_5VLTemplate, ``Dataset(features=)`` for
image columns; an unknown template name lists the valid ones (DeepseekV4Template among them)."""

import pytest

from twinkle.template import get_template
from twinkle.utils.errors import UserError


@pytest.mark.parametrize(("name", "what"), [("Gemma4Template", "multimodal templates")])
def test_a_planned_template_names_its_capability(name, what):
    with pytest.raises(UserError, match=f"{name} is not supported yet: {what}") as info:
        get_template(name)
    assert "valid names: Template, Qwen3_5Template" in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(
        UserError, match="unknown template 'NoSuch'; valid names: Template, Qwen3_5Template"
    ) as info:
        get_template("NoSuch")
    assert "DeepseekV4Template" in str(info.value)


def test_the_command_line_says_the_same():
    from twinkle.cli import CLI

    with pytest.raises(UserError, match="Gemma4Template is not supported yet: multimodal templates"):
        CLI.from_args(["--template-cls", "Gemma4Template"], env={})


def test_a_dataset_schema_for_image_columns_is_one_line():
    from twinkle.dataset import Dataset

    with pytest.raises(UserError, match=r"Dataset\(features=...\) is not supported yet: .*multimodal"):
        Dataset(features={"image": "Image"})
