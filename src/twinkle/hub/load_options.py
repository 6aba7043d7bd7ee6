"""``pretrained_options()``: the ``from_pretrained`` keywords every model load passes."""

from typing import Any


def pretrained_options() -> dict[str, Any]:
    """transformers' own hub kernels off (``use_kernels=False``), where this transformers has them.
    Transformers 5 turns them on whenever the ``kernels`` package is installed; a hub kernel not
    in the local cache would then be fetched over the network, and the model re-kernelized at every
    ``train()``/``eval()`` switch (a walk of every module, twice in a DPO step). ``twinkle.kernel.kernelize`` chooses the layers' kernels, from the local cache only."""
    import transformers

    return {"use_kernels": False} if hasattr(transformers.PreTrainedModel, "use_kernels") else {}
