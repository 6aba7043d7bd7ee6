"""``Engine``: the server's handle on its model, in the server's process whatever the mode.

It checks each request's inputs (datums, loss, AdamW parameters) and hands every operation to a
``twinkle.server.core.ModelCore``, whole: with ``--mode local`` the core is in this process; with
``--mode ray`` it lives on the device group ``model`` of the single controller and the same calls
run on its ranks (``twinkle.server.ray_groups``). Calls come one at a time from the queue's worker
thread; each names its adapter, so tenants never see each other's weights or optimizer state.

Sampling runs on the model itself (``ModelCore.sample``, with the checkpoint loaded into a slot
for the request), or, with a sampler group (``--mode ray``, ``--sampler-ranks`` > 0), on that
group's own copy of the base model (``sample_checkpoint``): the checkpoint's LoRA weights are
sent there first unless it holds them already, as ``CheckpointEngineManager`` sends a trainer's."""

import math
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twinkle.checkpoint.layout import MARKER
from twinkle.server.config import ServerConfig
from twinkle.server.core import LOSS_INPUTS, ModelCore
from twinkle.server.errors import BadRequest
from twinkle.server.scoring import Scoring
from twinkle.server.wire import Datum, check_datum


class Engine:
    """``core``: a ``ModelCore`` or its proxy on the model group; ``sampler``: the proxy of a
    ``ray_groups.SamplerCore`` on the sampler group, or None (sampling runs on the model)."""

    def __init__(self, core: Any, sampler: Any = None):
        self.core, self.sampler = core, sampler
        self.vocab, self.pad_id = int(core.vocab), int(core.pad_id)
        context = core.context
        self.context: int | None = None if context is None else int(context)  # the model's positions
        # sampling on the model in this process runs in slices (``ModelCore.sample_steps``)
        self.sliced = isinstance(core, ModelCore)
        # the sampler group's adapter of each LoRA rank -> the checkpoint it holds (folder, mtime)
        self.held: dict[str, tuple[str, int]] = {}
        self.in_use: set[str] = set()  # the adapters holding a slot on the model

    @property
    def has_sampler(self) -> bool:
        return self.sampler is not None

    # ---------------------------------------------------------------- adapters
    def add(self, name: str, rank: int) -> None:
        self.core.add(name, rank)
        self.in_use.add(name)

    def remove(self, name: str) -> None:
        self.core.remove(name)
        self.in_use.discard(name)

    def free_slots(self) -> int:
        return self.core.free_slots()

    # ---------------------------------------------------------------- training
    def forward_backward(
        self, name: str, data: list[Datum], loss_fn: str, config: dict[str, Any], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """One pass (with backward unless ``forward_only``); per datum its targets' ``logprobs``
        and ``elementwise_loss``, and the ``loss:sum`` metric."""
        if loss_fn not in LOSS_INPUTS:
            raise BadRequest(f"loss_fn {loss_fn!r} is not supported; use one of {', '.join(LOSS_INPUTS)}")
        for i, d in enumerate(data):
            check_datum(d, i, self.vocab, LOSS_INPUTS[loss_fn])
        return self.core.run_datums(name, data, loss_fn, config, forward_only)

    def optim_step(self, name: str, adam: dict[str, float]) -> dict[str, float]:
        """AdamW with the request's ``adam_params`` (``learning_rate``, ``beta1``, ``beta2``,
        ``eps``, ``weight_decay``, ``grad_clip_norm``; Tinker's defaults)."""
        params = {
            "lr": float(adam.get("learning_rate", 1e-4)),
            "betas": (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
            "eps": float(adam.get("eps", 1e-12)),
            "weight_decay": float(adam.get("weight_decay", 0.0)),
        }
        bad = [k for k, v in adam.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad or params["lr"] < 0:
            raise BadRequest(
                f"adam_params: {', '.join(bad) or 'learning_rate'} must be a finite non-negative number"
            )
        return self.core.optim_step(name, params, float(adam.get("grad_clip_norm", 0.0) or 0.0))

    # ---------------------------------------------------------------- checkpoints
    def save(self, name: str, folder: Path, optimizer: bool) -> None:
        self.core.save(name, folder, optimizer)

    def load(self, name: str, folder: Path, optimizer: bool) -> None:
        self.core.load(name, folder, optimizer)

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        return self.core.adapter_state(name)

    # ---------------------------------------------------------------- sampling
    def score_prompt(self, name: str, prompt: list[int], want: Scoring) -> dict[str, Any]:
        """What ``want`` asks of the prompt under adapter ``name`` (``ModelCore.score_prompt``)."""
        return self.core.score_prompt(name, prompt, want)

    def topk_of_completions(
        self, name: str, prompt: list[int], completions: list[list[int]], k: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per completion, the top ``k`` (ids, log-probs) at each of its positions."""
        return self.core.topk_of_completions(name, prompt, completions, k)

    def sample(self, name: str, prompt: list[int], params: dict[str, Any], n: int, seed: int) -> list[tuple]:
        """``n`` completions under adapter ``name`` of the model itself: (tokens, their log-probs
        at temperature 1, "stop"|"length")."""
        return self.core.sample(name, prompt, params, n, seed)

    def sample_steps(
        self, name: str, prompt: list[int], params: dict[str, Any], n: int, seed: int, slice_seconds: float
    ) -> Generator[None, None, list[tuple]]:
        """``sample`` as a generator of slices (``ModelCore.sample_steps``; ``sliced`` only)."""
        return self.core.sample_steps(name, prompt, params, n, seed, slice_seconds)

    def sample_checkpoint(
        self, folder: Path | None, rank: int, prompt: list[int], params: dict[str, Any], n: int, seed: int
    ) -> list[tuple]:
        """``n`` completions on the sampler group, from the adapter saved in ``folder`` (rank
        ``rank``), or from the base model (``folder`` None)."""
        from twinkle.server.ray_groups import folder_payload

        name = ""
        if folder is not None:
            name = f"r{rank}"  # one adapter per LoRA rank on the sampler's copy, rewritten in place
            stamp = (str(folder), (folder / MARKER).stat().st_mtime_ns)
            if self.held.get(name) != stamp:
                self.held.pop(name, None)
                payload = self.core.run_on_ranks(folder_payload, folder, keep=True).first()
                self.sampler.hold(name, payload)
                self.held[name] = stamp
        return list(self.sampler.keep_on_ranks("sample", name, prompt, params, n, seed).gather())


def build_engine(config: ServerConfig) -> Engine:
    """The model in this process (``--mode local``), or on the Ray groups (``--mode ray``)."""
    if config.mode == "ray":
        from twinkle.server.ray_groups import start_groups

        return Engine(*start_groups(config))
    return Engine(ModelCore(config.model_id, config.max_loras, config.max_r))
