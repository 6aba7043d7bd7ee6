"""``Engine``: where the model's work runs, seen from the server's process.

The model is a ``twinkle.server.core.ModelCore``: in this process (``--mode local``), or on every
rank of the device group ``model`` (``--mode ray``, ``twinkle.server.ray_groups``), where the same
calls run on its ranks. Either way the routes call its operations directly on ``Engine.core``:
they take and return plain values, so the two placements behave the same. ``Engine`` keeps what
only the server's process can know about that placement, read without a call to the ranks:

- the served model's image path (``vision``, ``twinkle.server.images``: its image processor and
  tokens, None for a text model), so images are decoded and processed here and the model's
  ranks receive the processed arrays;
- the model's constants (``vocab``, ``pad_id``, ``context``) and whether sampling on it runs in
  slices (``sliced``: in this process only, where every sample joins the model's shared decoding
  batch, ``ModelCore.sample_steps``);
- the adapter slots in use (``add``, ``remove``, ``in_use``; the metrics read them);
- the sampler group (``--sampler-ranks`` > 0): its own copy of the base model, and the checkpoint
  each of its adapters holds, so ``sample_checkpoint`` sends a checkpoint's LoRA weights there
  only when it does not hold them already (as ``CheckpointEngineManager`` sends a trainer's).

It is not part of ``ModelCore`` because, with ``--mode ray``, a ``ModelCore`` lives on the
model's ranks, and these facts belong to the server's process (a slot count the metrics read
without a remote call, the sampler group that the model's ranks do not see). It has no method
that only forwards to ``ModelCore``: those would rename its operations and nothing more.

Calls come one at a time from the queue's worker thread; each names its adapter, so tenants
never see each other's weights or optimizer state."""

from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import MARKER
from twinkle.server.config import ServerConfig
from twinkle.server.core import ModelCore
from twinkle.server.images import load_vision
from twinkle.server.ray_groups import folder_payload, start_groups


class Engine:
    """``core``: a ``ModelCore`` or its proxy on the model group; ``sampler``: the proxy of a
    ``ray_groups.SamplerCore`` on the sampler group, or None (sampling runs on the model)."""

    def __init__(self, core: Any, sampler: Any = None, vision: Any = None):
        self.core, self.sampler, self.vision = core, sampler, vision
        self.vocab, self.pad_id = int(core.vocab), int(core.pad_id)
        context = core.context
        self.context: int | None = None if context is None else int(context)  # the model's positions
        # sampling on the model in this process runs in slices of one shared decoding batch
        # (``ModelCore.sample_steps``)
        self.sliced = isinstance(core, ModelCore)
        # the sampler group's adapter of each LoRA rank -> the checkpoint it holds (folder, mtime)
        self.held: dict[str, tuple[str, int]] = {}
        self.in_use: set[str] = set()  # the adapters holding a slot on the model

    @property
    def has_sampler(self) -> bool:
        return self.sampler is not None

    # ---------------------------------------------------------------- adapter slots
    def add(self, name: str, rank: int) -> None:
        self.core.add(name, rank)
        self.in_use.add(name)

    def remove(self, name: str) -> None:
        self.core.remove(name)
        self.in_use.discard(name)

    def free_slots(self) -> int:
        return self.core.free_slots()

    # ---------------------------------------------------------------- the sampler group
    def sample_checkpoint(
        self,
        folder: Path | None,
        rank: int,
        prompt: list[int],
        params: dict[str, Any],
        n: int,
        seed: int,
        vision: dict[str, Any] | None = None,
    ) -> list[tuple]:
        """``n`` completions on the sampler group, from the adapter saved in ``folder`` (rank
        ``rank``), or from the base model (``folder`` None): (tokens, their log-probs at
        temperature 1, "stop"|"length"). ``vision``: the prompt's placed images."""
        name = ""
        if folder is not None:
            name = f"r{rank}"  # one adapter per LoRA rank on the sampler's copy, rewritten in place
            stamp = (str(folder), (folder / MARKER).stat().st_mtime_ns)
            if self.held.get(name) != stamp:
                self.held.pop(name, None)
                payload = self.core.run_on_ranks(folder_payload, folder, keep=True).first()
                self.sampler.hold(name, payload)
                self.held[name] = stamp
        return list(self.sampler.keep_on_ranks("sample", name, prompt, params, n, seed, vision).gather())


def build_engine(config: ServerConfig) -> Engine:
    """The model in this process (``--mode local``), or on the Ray groups (``--mode ray``)."""
    vision = load_vision(config.model_id)
    if config.mode == "ray":
        return Engine(*start_groups(config), vision=vision)
    return Engine(ModelCore(config.model_id, config.max_loras, config.max_r), vision=vision)
