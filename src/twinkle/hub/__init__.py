"""Resolve model and dataset ids to local things, without a network unless one is needed.

Public names:

- ``resolve_model(model_id)``: a local folder that ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained`` load. ``None`` is the bundled SmolLM2-135M-Instruct.
- ``check_model_folder(folder, name=None, weights=True)``: one ``UserError`` line naming what
  makes a model folder unusable (config, model type, tokenizer files, weights), before any load;
  ``resolve_model`` runs it on every folder the user gives.
- ``check_adapter_folder(folder)``: one ``UserError`` line when a saved LoRA adapter's config
  and tensors disagree (its rank ``r``), before PEFT loads it; returns the config.
- ``resolve_dataset(dataset_id, subset_name=None, split='train')``: a ``datasets.Dataset``.
  ``None`` is the bundled self-cognition data.
- ``bundled_gguf_path()``: the GGUF file of the bundled default model.
- ``ensure_converted(final, build_fn)``: build a cache folder once across processes.
- ``cache_root()``: ``$TWINKLE_CACHE`` or ``~/.cache/twinkle``.
- ``pretrained_options()``: the ``from_pretrained`` keywords every model load passes (transformers'
  own hub kernels off).
"""

from twinkle.hub.cache import ensure_converted
from twinkle.hub.check_adapter import check_adapter_folder
from twinkle.hub.check_folder import check_model_folder
from twinkle.hub.dataset import resolve_dataset
from twinkle.hub.gguf import bundled_gguf_path
from twinkle.hub.load_options import pretrained_options
from twinkle.hub.model import resolve_model
from twinkle.utils.cache import cache_root

__all__ = [
    "bundled_gguf_path",
    "cache_root",
    "check_adapter_folder",
    "check_model_folder",
    "ensure_converted",
    "pretrained_options",
    "resolve_dataset",
    "resolve_model",
]
