"""The plain records that preprocessors, templates and scripts pass around.

Public names: ``Message``, ``ToolCall``, ``Tool``, ``Trajectory``, ``InputFeature``. Each is a
``TypedDict``: at run time a record is an ordinary ``dict`` (JSON-serialisable, storable as a
row of a Hugging Face ``datasets.Dataset``), and the class only names and types its keys. A
preference preprocessor returns ``{'positive': Trajectory, 'negative': Trajectory}``.

A sampler's records (``twinkle.data_format.sampling``) are dataclasses: ``SamplingParams``,
``SampleResponse``, ``SampledSequence``."""

from twinkle.data_format.input_feature import InputFeature
from twinkle.data_format.message import Message, Tool, ToolCall
from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams
from twinkle.data_format.trajectory import Trajectory

__all__ = [
    "Message",
    "ToolCall",
    "Tool",
    "Trajectory",
    "InputFeature",
    "SamplingParams",
    "SampleResponse",
    "SampledSequence",
]
