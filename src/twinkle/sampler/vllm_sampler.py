"""``vLLMSampler``: upstream's sampler class, on vLLM where it can run and on ``TorchSampler``
elsewhere.

A script written for a GPU cluster builds ``vLLMSampler(model_id=..., engine_args=...,
device_mesh=..., remote_group=...)``. Where vLLM is installed and a CUDA GPU is visible, the calls
run on vLLM (``twinkle.sampler.vllm_engine``); otherwise one warning says why, and the same calls
run on a ``TorchSampler`` with its own copy of the model, which takes the same ``engine_args``
(``twinkle.sampler.engine_args``). Either way the records returned are the same
(``SampleResponse``), so the script runs unchanged on a laptop.

The public calls are methods of this class (a ``remote_group`` proxy dispatches by the class's
methods); attributes (``template``, ``tokenizer``, ``merged_keys``, ...) are the backend's."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle.data_format.sampling import SampleResponse, SamplingParams
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.sampler.vllm_engine import vllm_missing
from twinkle.utils.logger import get_logger


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class vLLMSampler:  # noqa: N801  (upstream's name)
    """``vLLMSampler(model_id, engine_args=None, device_mesh=None)``; see the module docstring.
    ``backend``: the ``VllmEngine`` or ``TorchSampler`` that runs the calls."""

    def __init__(
        self,
        model_id: str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        device_mesh: Any = None,
    ):
        reason = vllm_missing()
        if reason is None:
            from twinkle.sampler.vllm_engine import VllmEngine

            backend: Any = VllmEngine(model_id, dict(engine_args or {}), device_mesh)
        else:
            get_logger().warning(
                f"vLLMSampler: {reason}; its calls run on TorchSampler (plain PyTorch) instead"
            )
            backend = TorchSampler(model_id, engine_args, device_mesh)
        object.__setattr__(self, "backend", backend)

    def __getattr__(self, name: str) -> Any:
        if name == "backend" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.backend, name, value)

    def sample(
        self,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        adapter_name: str = "",
        adapter_path: str | Path | None = None,
        *,
        use_base_model: bool = False,
    ) -> list[SampleResponse]:
        """``TorchSampler.sample``'s contract."""
        return self.backend.sample(
            inputs, sampling_params, adapter_name, adapter_path, use_base_model=use_base_model
        )

    def set_template(
        self, template_cls: Any = "Template", model_id: str | None = None, **kwargs: Any
    ) -> None:
        """``TorchSampler.set_template``'s contract (``kwargs``: the template's keywords, checked
        by name)."""
        self.backend.set_template(template_cls, model_id=model_id, **kwargs)

    def reset_prefix_cache(self) -> None:
        self.backend.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        self.backend.reset_mm_cache()

    def reset_encoder_cache(self) -> None:
        self.backend.reset_encoder_cache()

    def receive_lora(self, adapter_name: str, config: Any, tensors: dict[str, Any]) -> int:
        """A trainer's adapter (``CheckpointEngineManager.sync_weights``)."""
        return self.backend.receive_lora(adapter_name, config, tensors)

    def receive_base_weights(self, weights: dict[str, Any], merged: bool) -> int:
        """A trainer's merged weights (``sync_weights(merge_and_sync=True)``)."""
        return self.backend.receive_base_weights(weights, merged)
