"""Samplers: generate from the model being trained, for reinforcement learning and evaluation.

Public names: ``TorchSampler`` (plain PyTorch, CPU or GPU, colocated with a
``TransformersModel`` or holding its own copy), ``vLLMSampler`` (the same contract on vLLM,
an optional extra for CUDA GPUs), and the records ``SamplingParams``, ``SampleResponse``,
``SampledSequence`` (from ``twinkle.data_format``)."""

from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.sampler.vllm_sampler import vLLMSampler

__all__ = ["TorchSampler", "vLLMSampler", "SamplingParams", "SampleResponse", "SampledSequence"]
