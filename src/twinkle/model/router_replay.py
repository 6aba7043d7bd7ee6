"""Routing replay for mixture-of-experts models: record each token's chosen experts, and route a
later forward of the same tokens to those experts.

A policy-gradient step weighs each sampled token by the ratio of the trained policy's probability
to the sampler's. In a mixture-of-experts model a small change of the weights (a step between
sampling and training, another kernel's rounding) can flip a router's top-k choice, and the
trained policy's probabilities are then those of another route than the one the token was drawn
with. Replay keeps the route: each router's top-k experts are the recorded ones, and their weights
are still computed from the current router logits as the family computes the weights of the
experts it chose (``ROUTERS``), so the router keeps its gradient:

- Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE: a softmax over all experts, read at the
  recorded experts, renormalised where the family renormalises (``norm_topk_prob``);
- DeepSeek-V3: the sigmoid of each recorded expert's logit (its bias correction,
  ``e_score_correction_bias``, and the group limit only choose experts; they weigh nothing),
  renormalised where ``norm_topk_prob`` says, times ``routed_scaling_factor``;
- DeepSeek-V4: its scoring function (sqrt-softplus) of each recorded expert's logit, without the
  bias correction, renormalised, times ``routed_scaling_factor``;
- gpt-oss: a softmax over the recorded experts' logits alone.

DeepSeek-V4's hash-routed layers choose by a frozen token-to-expert table (``tid2eid``) and weigh
as its scored layers do. They are recorded and replayed like every other layer, so
``routed_experts`` keeps one layout over all MoE layers, and replay runs the recorded experts
there too rather than reading the table again: the recorded route is the table's choice for the
same token, so replaying the sampler's routes reproduces it, and wherever the two could part (a
table not the sampler's) the token keeps the route it was drawn with, which is what replay is for.

``RouterReplay.install(lm)`` hooks the routers of one model instance (``ROUTERS``; never the
class): a forward hook on each router reads or replaces its output ``(logits, weights,
experts)``, and a forward pre-hook on the decoder ends the previous call's mode, so a forward
nobody armed routes as the model does. The model arms each forward of a step (``arm``, called by
``twinkle.model.forward`` with the packed row's layout) according to the step's
``RouterReplayAction``; the armed routes stay for the backward, where activation checkpointing
runs the layers again. The sampler records every forward while it decodes (``recording``).

Routes travel as ``routed_experts``, upstream's name and shape: one ``(tokens, moe_layers, top_k)``
array per sequence (the sampler's covers the prompt and every sampled token but the last, which
the model never ran), a ``(rows, length, moe_layers, top_k)`` tensor in a batch. ``NO_ROUTE`` (-1)
marks a token without a recorded route, which the router routes itself."""

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from twinkle.distributed.sequence_parallel import SequenceGroup, gather_rows
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

NO_ROUTE = -1
KEY = "routed_experts"


def softmax_over_all(
    router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor, renormalise: bool | None
) -> torch.Tensor:
    """The Qwen routers' weights: a softmax over all experts in fp32 at the ``chosen`` ones,
    renormalised where ``renormalise`` (None: as the router's ``norm_topk_prob`` says)."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
    if renormalise is None:
        renormalise = bool(getattr(router, "norm_topk_prob", False))
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def sigmoid_scaled(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's weights: the sigmoid of the ``chosen`` experts' logits (without the bias
    correction, which only chooses), renormalised with the router's small denominator guard where
    ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = logits.float().sigmoid().gather(-1, chosen)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def scored_scaled(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's weights, for both of its routers: its scoring function (``score_fn``,
    sqrt-softplus by default) of the ``chosen`` experts' logits, in the logits' dtype and without
    the bias correction (which only chooses), renormalised with the router's small denominator
    guard, times ``routed_scaling_factor``."""
    weights = router.score_fn(logits).gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_over_chosen(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """gpt-oss's weights: a softmax over the ``chosen`` experts' logits, in the logits' dtype."""
    return torch.softmax(logits.gather(-1, chosen), dim=-1, dtype=logits.dtype)


# router class -> the weights of given experts from its logits, as the family weighs its own top-k.
# Each router returns ``(logits, top-k weights, top-k experts)``.
ROUTERS: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen2MoeTopKRouter": partial(softmax_over_all, renormalise=None),
    "Qwen3MoeTopKRouter": partial(softmax_over_all, renormalise=None),
    "Qwen3NextTopKRouter": partial(softmax_over_all, renormalise=None),
    "Qwen3_5MoeTopKRouter": partial(softmax_over_all, renormalise=True),
    "DeepseekV3TopkRouter": sigmoid_scaled,
    "DeepseekV4TopKRouter": scored_scaled,
    "DeepseekV4HashRouter": scored_scaled,
    "GptOssTopKRouter": softmax_over_chosen,
}
# the model types whose routers are in ROUTERS (read from a folder's config.json before loading)
MOE_MODEL_TYPES = (
    "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3", "deepseek_v4",
    "gpt_oss",
)  # fmt: skip
_ATTRIBUTE = "_twinkle_router_replay"  # the lm instance's RouterReplay


def refuse_dense_folder(model_id: Any, what: str = "enable_router_replay=True") -> None:
    """One line before any weight loads when ``model_id`` is a local folder whose config names a
    model type without routers (other ids are checked once loaded, ``RouterReplay.install``)."""
    config = Path(str(model_id)) / "config.json" if model_id is not None else None
    if config is None or not config.is_file():
        return
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # the loader says what is wrong with the folder
    model_type = saved.get("model_type") if isinstance(saved, dict) else None
    if model_type is not None and model_type not in MOE_MODEL_TYPES:
        raise UserError(_no_router(what, model_type, _has_experts(saved)))


def _has_experts(config: Any) -> bool:
    """Whether a config (or a config.json's dict) names routed experts, as the MoE families do."""
    text = config.get("text_config") or config if isinstance(config, dict) else config
    if not isinstance(text, dict):
        text = vars(getattr(text, "text_config", None) or text)
    return any(text.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _no_router(what: str, model_type: str, moe: bool = False) -> str:
    if moe:  # a mixture of experts whose router is not one routing replay hooks
        return (
            f"{what}: routing replay covers the routers of {', '.join(MOE_MODEL_TYPES)}; {model_type}'s "
            "router is not one of them; leave routing replay off for this model"
        )
    return (
        f"{what}: the model ({model_type}) has no mixture-of-experts router to replay; "
        f"routing replay covers {', '.join(MOE_MODEL_TYPES)}"
    )


def find_routers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers of a family in ``ROUTERS``, in layer order."""
    return [m for m in lm.modules() if type(m).__name__ in ROUTERS]


def replay_of(lm: Any) -> "RouterReplay | None":
    """The ``RouterReplay`` installed on causal LM ``lm``, if any."""
    return lm.__dict__.get(_ATTRIBUTE)


class RouterReplay:
    """The routers of one causal LM instance, hooked; see the module docstring. ``action`` is the
    running step's ``RouterReplayAction`` (None: route as the model does), set by the model."""

    def __init__(self, lm: torch.nn.Module, routers: list[torch.nn.Module]):
        self.routers = routers
        self.top_k = int(routers[0].top_k)
        self.action: RouterReplayAction | None = None
        self.recording = False  # every forward records (the sampler, while it decodes)
        self.recorded: list[torch.Tensor | None] = [None] * len(routers)
        self._armed: dict[str, Any] | None = None  # for the next forward
        self._current: dict[str, Any] | None = None  # the running forward's (and its backward's)
        self._handles = [
            router.register_forward_hook(self._hook(i, ROUTERS[type(router).__name__]))
            for i, router in enumerate(routers)
        ]
        decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm
        self._handles.append(decoder.register_forward_pre_hook(self._enter))

    @classmethod
    def install(cls, lm: torch.nn.Module, what: str = "enable_router_replay=True") -> "RouterReplay":
        """The routers of ``lm`` hooked (once per instance); ``UserError`` for a model without
        routers of a family in ``ROUTERS`` (``what`` names what asked for them)."""
        installed = replay_of(lm)
        if installed is not None:
            return installed
        routers = find_routers(lm)
        if not routers:
            model_type = getattr(getattr(lm, "config", None), "model_type", type(lm).__name__)
            raise UserError(_no_router(what, model_type, _has_experts(getattr(lm, "config", None) or {})))
        replay = cls(lm, routers)
        lm.__dict__[_ATTRIBUTE] = replay
        return replay

    @property
    def layers(self) -> int:
        return len(self.routers)

    # ------------------------------------------------------------------ the hooks
    def _enter(self, module: Any, args: Any) -> None:
        self._current, self._armed = self._armed, None

    def _hook(self, layer: int, weigh: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]):
        def hook(router: torch.nn.Module, args: Any, output: Any) -> Any:
            current = self._current
            if current is None and not self.recording:
                return None
            logits, weights, experts = output
            if current is not None and current["targets"] is not None:
                weights, experts = self._replayed(router, layer, weigh, logits, experts, weights.dtype)
                output = (logits, weights, experts)
            if self.recording or current is not None:
                self.recorded[layer] = experts.detach()
            return output

        return hook

    def _replayed(
        self,
        router: torch.nn.Module,
        layer: int,
        weigh: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        experts: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        targets = self._current["targets"][:, layer]
        if targets.shape != experts.shape:
            raise UserError(
                f"routed_experts give {targets.shape[0]} token(s) x top-{targets.shape[1]} for a "
                f"forward of {experts.shape[0]} x top-{experts.shape[1]}; pass the routes recorded "
                "for these same rows"
            )
        chosen = torch.where(targets >= 0, targets, experts)
        # as the router computes its own weights, at the recorded experts, in its weights' dtype
        return weigh(router, logits, chosen).to(dtype), chosen

    # ------------------------------------------------------------------ a step's forward
    def arm(self, batch: Mapping[str, Any], where: torch.Tensor | None) -> None:
        """Arm the next forward of ``batch`` (padded ``(B, L)``) by the step's ``action``:
        ``where`` (``twinkle.model.packing``) gives each padded position's place in the packed
        row the forward runs (-1: left out), None when the forward runs the padded batch."""
        if self.action is None:
            return
        mask = batch["attention_mask"]
        armed = {"where": where, "mask": mask, "targets": None}
        if self.action is not RouterReplayAction.RECORD:
            routes = batch.get(KEY)
            if routes is None and not bool((batch["labels"] != IGNORE_INDEX).any()):
                return  # a rank's empty share runs one unlabelled pad: routed as the model does
            if routes is None:
                raise UserError(
                    f"router_replay_action={self.action.name}, but the batch has no routed_experts; pass "
                    "rows that carry them (the sampler's, or forward_only(..., router_replay_action="
                    "RouterReplayAction.RECORD)['routed_experts'])"
                )
            flat = self.check(routes, tuple(mask.shape)).flatten(0, 1)
            if where is not None:
                flat = flat[sources(where)]
            armed["targets"] = flat.to(device=mask.device, dtype=torch.long)
        self._armed = armed
        self.recorded = [None] * self.layers

    def share(self, group: SequenceGroup, span: tuple[int, int, int, int]) -> None:
        """The armed forward runs one share of its positions (Ulysses, ``twinkle.model.ulysses``):
        ``span`` is ``(rows, length, start, end)``, positions ``start:end`` of each of its ``rows``
        of ``length`` padded to a multiple of ``group.size``. The share's routes are replayed (the
        padding's are ``NO_ROUTE``: the router routes those tokens itself), and
        ``recorded_routes`` gathers every share's recorded routes back into whole rows."""
        armed = self._armed
        if armed is None:
            return
        rows, length, start, end = span
        armed["share"] = (group, rows, length)
        targets = armed["targets"]
        if targets is not None:
            # every position of the forward's rows, NO_ROUTE past the last one a batch row maps to
            shape = (self.layers, self.top_k)
            ran = targets.new_full((rows * length, *shape), NO_ROUTE)
            ran[: targets.shape[0]] = targets
            whole = targets.new_full((rows, group.size * (end - start), *shape), NO_ROUTE)
            whole[:, :length] = ran.reshape(rows, length, *shape)
            armed["targets"] = whole[:, start:end].flatten(0, 1)

    def check(self, routes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``routes`` as ``(B, L, moe_layers, top_k)`` for a batch of ``shape`` ``(B, L)``."""
        want = (*shape, self.layers, self.top_k)
        if tuple(routes.shape) != want:
            raise UserError(
                f"routed_experts has shape {tuple(routes.shape)}, but this batch and model take {want} "
                "(rows, length, MoE layers, top-k)"
            )
        return routes

    def recorded_routes(self) -> torch.Tensor | None:
        """The last armed forward's experts as ``(B, L, moe_layers, top_k)`` on the CPU,
        ``NO_ROUTE`` at pads and at positions the packed row left out; None if it recorded none.
        After a forward of one share of the positions (``share``) it gathers the other shares'
        over the group, a collective: every rank of the group reads them, as ``forward_only``
        does."""
        armed = self._current
        if armed is None or any(r is None for r in self.recorded):
            return None
        mask = armed["mask"]
        rows, length = mask.shape
        ran = torch.stack(self.recorded, dim=1)  # (forward's tokens, layers, k)
        if armed.get("share") is not None:  # one share of each row's positions: gather the group's
            group, forward_rows, forward_length = armed["share"]
            mine = ran.reshape(forward_rows, -1, self.layers, self.top_k).transpose(0, 1)
            ran = torch.cat(gather_rows(mine, group)).transpose(0, 1)[:, :forward_length].flatten(0, 1)
        where = armed["where"]
        if where is None:
            out = ran.reshape(rows * length, self.layers, self.top_k).clone()
            out[~mask.reshape(-1).bool()] = NO_ROUTE
        else:
            out = ran.new_full((rows * length, self.layers, self.top_k), NO_ROUTE)
            flat = where.reshape(-1)
            kept = flat >= 0
            out[kept] = ran[flat[kept]]
        return out.reshape(rows, length, self.layers, self.top_k).cpu()

    @contextmanager
    def recording_all(self) -> Iterator[None]:
        """Record every forward (the sampler's decoding); ``take`` reads each one."""
        before = self.recording
        self.recording = True
        try:
            yield
        finally:
            self.recording = before

    def take(self) -> torch.Tensor:
        """The last forward's experts, ``(tokens, moe_layers, top_k)`` in the order of its inputs."""
        if any(r is None for r in self.recorded):
            raise AssertionError("a forward ran without reaching every router")
        taken = torch.stack(self.recorded, dim=1)
        self.recorded = [None] * self.layers
        return taken


def sources(where: torch.Tensor) -> torch.Tensor:
    """For each position of the packed row, the first padded position (flat index) it stands
    for: a shared prefix stands for every row of its group, and holds the first row's route."""
    flat = where.reshape(-1)
    kept = (flat >= 0).nonzero(as_tuple=True)[0]
    length = int(flat.max()) + 1
    first = torch.full((length,), flat.numel(), dtype=torch.long, device=flat.device)
    return first.scatter_reduce(0, flat[kept], kept, reduce="amin")


def as_routes(value: Any) -> torch.Tensor:
    """One sequence's routes (a tensor, an array or nested lists) as a ``(tokens, layers, k)``
    long tensor."""
    routes = torch.as_tensor(value).long() if not torch.is_tensor(value) else value.long()
    if routes.dim() != 3:
        raise UserError(
            f"a row's routed_experts has shape {tuple(routes.shape)}; expected (tokens, MoE layers, top-k)"
        )
    return routes


def batch_routes(
    samples: Sequence[Mapping[str, Any]], batch: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The rows' ``routed_experts`` laid out like ``batch`` (the processor's padded batch of the
    same rows, one batch row per sample): ``(B, L, layers, k)``, each row's routes on its first
    real positions, ``NO_ROUTE`` elsewhere; None when no row carries routes."""
    given = [s.get(KEY) if isinstance(s, Mapping) else None for s in samples]
    if all(g is None for g in given):
        return None
    mask = batch["attention_mask"].bool()
    if len(given) != mask.shape[0]:
        raise UserError(
            f"rows with routed_experts must be plain samples, one batch row each; {len(given)} row(s) "
            f"made {mask.shape[0]} batch rows (preference pairs or packed rows carry no routes)"
        )
    routes = [None if g is None else as_routes(g) for g in given]
    shape = next(r.shape[1:] for r in routes if r is not None)
    out = torch.full((*mask.shape, *shape), NO_ROUTE, dtype=torch.long)
    for i, r in enumerate(routes):
        if r is None:
            continue
        if tuple(r.shape[1:]) != tuple(shape):
            raise UserError(
                f"row {i}'s routed_experts has {tuple(r.shape[1:])} (MoE layers, top-k) per token; "
                f"another row's has {tuple(shape)}"
            )
        real = mask[i].nonzero(as_tuple=True)[0]
        if r.shape[0] > real.numel():  # a row of a recorded padded batch: its pads have no route
            if bool((r[real.numel() :] != NO_ROUTE).any()):
                raise UserError(
                    f"row {i}'s routed_experts cover {r.shape[0]} tokens, but the row has {real.numel()}"
                )
            r = r[: real.numel()]
        out[i, real[: r.shape[0]]] = r
    return out


def take_action(keywords: dict[str, Any]) -> RouterReplayAction | None:
    """Pop a step's ``router_replay_action`` (and upstream's ``router_replay_manual_cleanup``:
    the routes armed for a forward stay for its backward either way) from ``keywords``."""
    keywords.pop("router_replay_manual_cleanup", None)
    action = keywords.pop("router_replay_action", None)
    if action is not None and not isinstance(action, RouterReplayAction):
        raise UserError(f"router_replay_action={action!r}: expected a RouterReplayAction or None")
    return action
