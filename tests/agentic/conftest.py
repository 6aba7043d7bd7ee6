"""The agentic tests' fixtures; the scripted model and environment are in ``scripted.py`` (a
module of its own: ``from conftest import`` would pick whichever ``conftest`` loaded first)."""

import pytest

from twinkle.template import Template


@pytest.fixture(scope="session")
def template(tiny_model_dir) -> Template:
    return Template(str(tiny_model_dir))
