"""``twinkle_client``: the local API's names over a ``twinkle server``, so a script moves from
training in-process to training on the service by changing its imports.

    from twinkle_client import init_twinkle_client
    client = init_twinkle_client("http://127.0.0.1:8000", api_key="tml-...")
    model = client.MultiLoraTransformersModel()          # one adapter a call of add_adapter_to_model
    model.add_adapter_to_model("mine", LoraConfig(r=8))
    model.set_optimizer("AdamW", lr=1e-4, adapter_name="mine")
    model.forward_backward(inputs=rows, adapter_name="mine")
    model.clip_grad_and_step(adapter_name="mine")
    sampler = client.Sampler(model.save_for_sampler("s1", adapter_name="mine"))

After ``init_twinkle_client`` the classes are also importable as ``twinkle_client.model
.MultiLoraTransformersModel``, ``twinkle_client.sampler.vLLMSampler`` and ``.Sampler`` (they use
the last client initialised). ``init_tinker_client()`` readies the official Tinker SDK for a
``twinkle server`` instead. Every call goes over the same Tinker routes the official SDK uses
(through the SDK, which is the ``server`` extra's ``tinker``)."""

from twinkle_client.client import TwinkleClient, init_tinker_client, init_twinkle_client
from twinkle_client.connection import current_client

__all__ = ["TwinkleClient", "init_tinker_client", "init_twinkle_client", "current_client"]
