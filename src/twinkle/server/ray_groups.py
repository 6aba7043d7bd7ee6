"""``twinkle server --mode ray``: the model and the sampler on device groups of twinkle's single
controller (``twinkle.runtime.controller``), the HTTP front end, keys, queue and registry in the
server's process (the driver).

- group ``model``: ``--model-ranks`` ranks, each holding the ``ModelCore`` (FSDP2 over the ranks
  when there are several; each runs its share of a request's datums);
- group ``sampler``: ``--sampler-ranks`` ranks, each a ``SamplerCore`` with its own copy of the
  base model; with ``--sampler-ranks 0`` there is none and sampling runs on the model's group.

The cluster is ``--ray-address`` (else ``$RAY_ADDRESS``, else a local Ray instance started for
the server and stopped with it), checked to fit the groups before any model loads. Every rank
drives one device of the kind this process finds (``twinkle.utils.framework.Torch``): CUDA GPUs
where there are, else CPUs. The runs' folder (``--output-dir``) must be one the model's ranks and
this process both see (the same machine, or a shared file system): the model's rank 0 writes the
checkpoints the registry here lists."""

from pathlib import Path
from typing import Any

from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.server.config import ServerConfig
from twinkle.server.core import ModelCore
from twinkle.server.sampler_calls import run_sampler

MODEL_GROUP, SAMPLER_GROUP = "model", "sampler"


def start_groups(config: ServerConfig) -> tuple[Any, Any]:
    """Join or start the cluster, reserve the groups, build the model (and the sampler) on them;
    (the model's proxy, the sampler's proxy or None)."""
    import twinkle
    from twinkle import DeviceGroup
    from twinkle.runtime import RunDefaults
    from twinkle.utils.framework import Torch

    device = Torch.device_type()
    groups = [DeviceGroup(name=MODEL_GROUP, ranks=config.model_ranks, device_type=device)]
    if config.sampler_ranks:
        groups.append(DeviceGroup(name=SAMPLER_GROUP, ranks=config.sampler_ranks, device_type=device))
    twinkle.initialize(mode="ray", groups=groups, run=RunDefaults(ray_address=config.ray_address))
    core = ModelCore(config.model_id, config.max_loras, config.max_r, remote_group=MODEL_GROUP)
    sampler = None
    if config.sampler_ranks:
        sampler = SamplerCore(config.model_id, remote_group=SAMPLER_GROUP)
    return core, sampler


def stop_groups() -> None:
    """Stop the groups' workers and a local Ray instance (nothing without a controller)."""
    from twinkle.runtime.controller import active

    controller = active()
    if controller is not None:
        controller.shutdown()


def folder_payload(core: ModelCore, folder: Path) -> dict[str, Any] | None:
    """On the model's ranks: a saved adapter's LoRA config and weights, checked against its
    checksums, for the sampler group (rank 0's copy travels; the other ranks send nothing)."""
    from twinkle.checkpoint import integrity, layout
    from twinkle.sampler.adapters import read_folder

    if core.model.runtime.rank != 0:
        return None
    integrity.verify(folder, [layout.ADAPTER_WEIGHTS])
    config, tensors = read_folder(folder)
    return {"config": config, "tensors": tensors}


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class SamplerCore:
    """A ``TorchSampler`` with its own copy of the base model, and the LoRA adapters sent to it:
    one per LoRA rank, rewritten in place for each checkpoint it samples."""

    def __init__(self, model_id: str | None):
        from twinkle.sampler import TorchSampler

        self.sampler = TorchSampler(model_id)

    def hold(self, name: str, payload: dict[str, Any]) -> int:
        """Write the adapter weights of ``payload`` (``folder_payload``) into adapter ``name``
        (added on first use); the sampler's default stays the base model. Returns the bytes copied."""
        written = self.sampler.receive_lora(name, payload["config"], payload["tensors"])
        self.sampler.default_adapter = None  # adapter '' is the base model
        return written

    def sample(
        self,
        name: str,
        prompt: list[int],
        params: dict[str, Any],
        n: int,
        seed: int,
        vision: dict[str, Any] | None = None,
    ) -> list[tuple]:
        """This rank's share of ``n`` completions under adapter ``name`` ('' : the base model):
        with several ranks, rank r samples its contiguous share with seed ``seed + r``.
        ``vision``: the prompt's placed images (numpy arrays, which travel to the ranks as any
        argument does); the sampler's own copy of a vision-language checkpoint reads them."""
        rt = self.sampler.runtime
        base, extra = divmod(n, rt.world_size)
        mine = base + (1 if rt.rank < extra else 0)
        if mine == 0:
            return []
        return run_sampler(self.sampler, name, prompt, params, mine, seed + rt.rank, vision)
