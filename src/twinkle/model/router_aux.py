"""The MoE router's auxiliary (load-balancing) loss, added to a training step's loss.

A mixture-of-experts config with ``output_router_logits=True`` (the text config of a
vision-language model) asks for Switch Transformer's load-balancing loss, weighed by the family's
``router_aux_loss_coef``: with labels, transformers' ``*ForCausalLM.forward`` adds
``router_aux_loss_coef * aux_loss`` to its own loss. Twinkle's step never hands the model labels
(the head runs apart from the model, ``twinkle.model.forward``), so the step adds it here, with
the coefficient as transformers applies it (upstream Twinkle adds the raw ``aux_loss``, which
trains with the coefficient 1 whatever the config says).

``aux`` is transformers' ``load_balancing_loss_func`` over the forward's real tokens: for each
expert, the fraction of the top-k choices that pick it (``counts / rows``) times its mean router
probability (``probs / rows``), summed and multiplied by the number of experts, every MoE layer's
tokens pooled. The three sums are taken from the router logits of this forward, read by forward
hooks on the routers of this model instance (``AUX_ROUTERS``; never the class), and each token is
weighed by how many real tokens of the padded batch it stands for:

- a padded batch: its attention mask (pads weigh 0);
- a packed row (``twinkle.model.packing``): 1 per sample position, and a shared prefix held once
  counts once per sample that continues it. A training step with the aux keeps each sample's tail
  after its last target in the row (``counts_every_token``), so the row routes every real token
  of the padded batch and gives the same aux;
- Ulysses (``twinkle.model.ulysses``): a rank routes its share of the positions, so the sums are
  totalled over the group (the probabilities' gradient stays with each rank's own share): the
  group computes the aux of its whole rows, as one process would;
- expert parallelism: routers run on each rank's own tokens before the exchange; nothing changes.

Every training step adds it (``task='embedding'`` too, over the rows it pools). The step
backpropagates ``loss_sum + factor * aux`` (``RouterAux.step_term`` derives the factor from the
step's normalisation), returns the token loss plus ``coef * aux`` (transformers' ``outputs.loss``)
with ``aux_loss`` beside it, and ``calculate_metric`` reports ``aux_loss`` (the micro-batches'
mean) beside ``loss`` (the token loss).

A family whose transformers forward computes no aux (DeepSeek-V3), or ``router_aux_loss_coef``
0, adds nothing (one info line). An evaluation (``forward_only``) reports the token loss only:
the aux regularises routing while training, and an eval loss without it compares across runs of
any coefficient (transformers' forward, and upstream Twinkle's eval, add it whenever they are
given labels)."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from twinkle.distributed.collectives import all_reduce_sum
from twinkle.model.ulysses import ulysses_of
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()

# the router classes whose logits transformers' forward passes to ``load_balancing_loss_func``
# (its ``OutputRecorder(<router>, index=0)``); DeepSeek-V4's hash-routed layers are not among them
AUX_ROUTERS = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "Qwen3NextTopKRouter",
    "Qwen3_5MoeTopKRouter",
    "DeepseekV4TopKRouter",
    "GptOssTopKRouter",
)
_ATTRIBUTE = "_twinkle_router_aux"


def _text_config(lm: Any) -> Any:
    cfg = lm.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _family_has_aux(lm: Any) -> bool:
    """Whether the model's transformers module computes a load-balancing loss in its forward."""
    return hasattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func")


def router_aux_of(lm: Any) -> "RouterAux | None":
    """The ``RouterAux`` installed on causal LM ``lm``, if any."""
    return lm.__dict__.get(_ATTRIBUTE)


def counts_every_token(lm: Any) -> bool:
    """Whether the running forward needs every real token routed (a training step with the aux):
    a packed row then keeps each sample's tail after its last target."""
    aux = router_aux_of(lm)
    return aux is not None and aux.capturing


class RouterAux:
    """The aux of one causal LM instance: hooks on its routers and on its forward's inputs,
    capturing while a training step runs (``capture``)."""

    def __init__(self, lm: torch.nn.Module, routers: list[torch.nn.Module], top_k: int, coef: float):
        self.lm = lm
        self.top_k = top_k
        self.coef = coef
        self.capturing = False
        self._logits: list[torch.Tensor] = []
        self._weights: torch.Tensor | None = None  # the forward's per-position token weights
        self._recorded: dict[str, list[float]] = {}  # adapter -> [sum, count] since calculate_metric
        self._handles = [r.register_forward_hook(self._read_logits) for r in routers]
        self._handles.append(lm.register_forward_pre_hook(self._read_inputs, with_kwargs=True))

    @classmethod
    def install(cls, lm: torch.nn.Module) -> "RouterAux | None":
        """Hook ``lm`` (a ``*ForCausalLM``) when its config asks for the aux; None when it does not,
        when its family computes none or its coefficient is 0 (both said in one line)."""
        cfg = _text_config(lm)
        if not getattr(cfg, "output_router_logits", False):
            return None
        coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
        kind = getattr(cfg, "model_type", type(lm).__name__)
        if not _family_has_aux(lm):
            logger.info("output_router_logits=True: %s computes no load-balancing loss; none is added", kind)
            return None
        if coef == 0.0:
            logger.info("output_router_logits=True with router_aux_loss_coef=0: no load-balancing loss added")
            return None
        routers = [m for m in lm.modules() if type(m).__name__ in AUX_ROUTERS]
        if not routers:
            raise UserError(
                f"output_router_logits=True: {kind}'s load-balancing loss reads routers twinkle does not "
                f"hook (it hooks {', '.join(AUX_ROUTERS)}); set output_router_logits=False in the config"
            )
        aux = cls(lm, routers, int(cfg.num_experts_per_tok), coef)
        lm.__dict__[_ATTRIBUTE] = aux
        return aux

    # ------------------------------------------------------------------ the hooks
    def _read_logits(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.capturing:  # a recomputed forward (activation checkpointing) adds nothing
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    def _read_inputs(self, module: torch.nn.Module, args: Any, kwargs: dict) -> None:
        if self.capturing:
            self._weights = token_weights(self.lm, kwargs)

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Read the router logits of the forwards run inside (a training step's forward)."""
        self._logits, self._weights, self.capturing = [], None, True
        try:
            yield
        finally:
            self.capturing = False

    def loss(self) -> torch.Tensor | None:
        """The aux of the captured forward (its graph reaches the routers), or None when no router
        ran. Under Ulysses a collective: every rank of the group calls it."""
        logits, weights = self._logits, self._weights
        self._logits, self._weights = [], None
        if not logits:
            return None
        counts, probs, rows = expert_sums(logits, weights, self.top_k)
        ulysses = ulysses_of(self.lm)
        if ulysses is not None:
            counts, probs, rows = group_sums(counts, probs, rows, ulysses.group.group)
        if float(rows) == 0:
            return probs.sum() * 0.0  # no real token routed: nothing to balance, the graph kept
        return (counts / rows * (probs / rows)).sum() * counts.shape[0]

    def step_term(self, num_tokens: int, has_rows: bool) -> tuple[torch.Tensor, float] | None:
        """``(aux, factor)``: the step backpropagates ``loss_sum + factor * aux``. A collective (the
        micro-batch's loss count and the ranks with rows, over all ranks): every rank calls it.
        ``has_rows``: False for a rank's empty share of a short last batch (it runs one pad token,
        whose aux is left out: None).

        The step's gradients are token-loss sums, averaged over the ranks by FSDP and multiplied by
        ``world_size / N`` when the window closes (``N``: the window's loss count over all ranks,
        ``optimizer_step``). ``factor = coef * n / d``, with ``n`` this micro-batch's count over
        all ranks and ``d`` the data ranks with rows (a Ulysses group is one: its ranks'
        gradients add up to its aux's), makes the aux's gradient ``coef`` times the mean of those
        ranks' aux whenever the window is one micro-batch, as transformers' loss is under DDP; a
        rank without rows adds nothing. In a window of several, each micro-batch's mean weighs
        ``n / N``, its share of the window's count: the factor is fixed at the backward, before
        the later micro-batches' counts exist, and the gradients it lands in are the token
        loss's; micro-batches of equal counts give the plain mean."""
        aux = self.loss()
        total, ranks = all_reduce_sum([float(num_tokens), float(has_rows)])
        if aux is None or not has_rows:
            return None
        ulysses = ulysses_of(self.lm)
        return aux, self.coef * total * (1 if ulysses is None else ulysses.size) / ranks

    def record(self, adapter_name: str, value: float) -> None:
        """A micro-batch's aux, for the next ``metrics``."""
        kept = self._recorded.setdefault(adapter_name, [0.0, 0.0])
        kept[0], kept[1] = kept[0] + value, kept[1] + 1

    def metrics(self, adapter_name: str) -> dict[str, float]:
        """``{"aux_loss": the mean aux of the micro-batches since the last call, over all ranks}``
        (a collective; a Ulysses group's ranks hold the same aux, so each group counts alike)."""
        value, count = all_reduce_sum(self._recorded.pop(adapter_name, [0.0, 0.0]))
        return {"aux_loss": value / count} if count else {}


def capturing(aux: RouterAux | None) -> Any:
    """``aux.capture()``, or nothing to capture without the aux."""
    return nullcontext() if aux is None else aux.capture()


def with_aux(result: dict[str, Any], aux: RouterAux | None, term: tuple[torch.Tensor, float] | None) -> dict:
    """A training forward's ``{"loss", "num_tokens"}`` with the aux: ``aux_loss`` beside the token
    loss, and ``loss`` the loss trained on, ``coef * aux`` added as in transformers' ``outputs.loss``."""
    if aux is None or term is None:
        return result
    value = float(term[0].detach())
    return {**result, "loss": result["loss"] + aux.coef * value, "aux_loss": value}


def trained_loss(
    loss_sum: torch.Tensor, term: tuple[torch.Tensor, float] | None
) -> tuple[torch.Tensor, float | None]:
    """What the step backpropagates (``loss_sum + factor * aux``, ``RouterAux.step_term``) and the
    aux's value (None without it)."""
    if term is None:
        return loss_sum, None
    aux, factor = term
    return loss_sum + factor * aux, float(aux.detach())


def aux_entry(step: Any, value: float | None) -> Any:
    """``step`` (the step's ``StepOutputs``) with ``aux_loss`` set where the step added the aux."""
    if value is not None:
        step["aux_loss"] = value
    return step


def token_weights(lm: Any, kwargs: dict) -> torch.Tensor:
    """How many real tokens of the padded batch each position of this forward stands for, flat in
    the order the routers see them (row-major)."""
    mask = kwargs.get("attention_mask")
    segments = kwargs.get("twinkle_segments")
    ulysses = ulysses_of(lm)
    if segments is None:  # padded: the mask (Ulysses pads carry 0)
        if mask is None:
            return torch.ones(kwargs["input_ids"].numel())
        return mask.reshape(-1).float()
    length = ulysses.span[1] if ulysses is not None else segments.length
    weights = torch.zeros(segments.length, device=mask.device if mask is not None else None)
    for (start, end), (begin, shared) in zip(segments.spans, segments.contexts(), strict=True):
        if start >= length:  # the positions Ulysses pads the row with
            continue
        weights[start:end] += 1
        weights[begin : begin + shared] += 1
    if ulysses is not None:
        _, _, start, end = ulysses.span
        weights = weights[start:end]
    return weights


def expert_sums(
    logits: list[torch.Tensor], weights: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts, probs, rows)`` over every layer's tokens, as ``load_balancing_loss_func`` sums
    them (its softmax and top-k in the logits' dtype, its sums in fp32), each token weighed."""
    experts = logits[0].shape[-1]
    device = logits[0].device
    w = (
        torch.ones(logits[0].shape[0], device=device)
        if weights is None
        else weights.to(device=device, dtype=torch.float32)
    )
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    for layer in logits:
        routing = torch.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        counts = counts + torch.zeros_like(counts).scatter_add_(
            0, chosen.reshape(-1), w.repeat_interleave(top_k)
        )
        probs = probs + (routing.float() * w[:, None]).sum(dim=0)
    rows = w.sum() * len(logits)
    return counts.detach(), probs, rows.detach()


def group_sums(
    counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sums totalled over a Ulysses group; the probabilities' gradient flows to this rank's own
    share only, so the group's ranks' gradients add up to the whole rows' gradient."""
    packed = torch.cat([counts, probs.detach(), rows.reshape(1)])
    if dist.get_backend(group) == "gloo":
        total = packed.cpu()
        dist.all_reduce(total, group=group)
        total = total.to(packed.device)
    else:
        total = packed.clone()
        dist.all_reduce(total, group=group)
    n = counts.shape[0]
    return total[:n], probs + (total[n : 2 * n] - probs.detach()), total[2 * n]
