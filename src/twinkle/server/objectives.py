"""Twinkle's own losses (the DPO and GRPO families, any ``twinkle.loss`` name that needs only the
targets' log-probabilities) over the Tinker ``forward_backward`` route.

Such a loss is a function ``C(logp)`` of the per-token log-probabilities of the targets (and of
the request's reference log-probs, old log-probs and advantages). Its gradient is
``dC/dtheta = sum_t dC/dlogp_t * dlogp_t/dtheta``, which is the gradient of the token-weighted
cross entropy ``-sum_t w_t * logp_t`` with ``w_t = -dC/dlogp_t``. So the server runs it in three
moves on the model it already has: a forward pass for ``logp`` (no graph), ``C`` and its
gradient in ``logp`` on the CPU, and one ``cross_entropy`` backward with those weights. The
step's divisor is the loss's own count (tokens or pairs, ``twinkle_count``), so a window of
several calls is normalised as the local ``forward_backward`` normalises it.

Requests name the loss two ways:

- ``loss_fn_config={"twinkle_loss": "<name in twinkle.loss.LOSSES>", <its arguments>}``
  (what ``twinkle_client`` sends); text values come as text, numbers as floats, a float that
  is a whole number goes to an integer argument as an integer;
- upstream's Tinker DPO: ``importance_sampling`` with ``ref_logps`` in every datum's
  ``loss_fn_inputs`` is ``DPOLoss(beta=dpo_beta, sft_weight=dpo_sft_weight)``.

The per-token inputs are each datum's ``weights`` (1 on the trained tokens), ``ref_logps``,
``logprobs`` (the sampler's, the loss's ``old_logps``) and ``advantages``.

A preference loss (the DPO family: datums in pairs, chosen then rejected) also reports
``twinkle.metric.DPOMetric``'s numbers over the call's pairs, among the call's metrics under the
SDK's reduction suffixes (``chosen_reward:mean``, ``reward_accuracy:mean``, ``pairs:sum``, ...),
and over the window at the next ``optim_step`` under the metric's own names with the window's
mean ``loss`` (``Window``), as upstream's Tinker DPO reports them."""

import inspect
import typing
from typing import Any

import numpy as np
import torch

from twinkle.metric.dpo import DPOMetric
from twinkle.server.errors import BadRequest
from twinkle.server.wire import Datum

LOSS_KEY = "twinkle_loss"
COUNT_KEY = "twinkle_count"  # the divisor a composite step hands the cross-entropy pass
STEP_INPUTS = {"ref_logps": "ref_logps", "logprobs": "old_logps", "advantages": "advantages"}
UPSTREAM_DPO = {"dpo_beta": "beta", "dpo_sft_weight": "sft_weight"}  # upstream's Tinker DPO keys
IGNORE = -100


def wanted(loss_fn: str, config: dict[str, Any], data: list[Datum]) -> bool:
    """Whether the request asks for a twinkle loss rather than one of the Tinker losses."""
    if LOSS_KEY in config:
        return True
    return loss_fn == "importance_sampling" and any("ref_logps" in d.inputs for d in data)


def build(loss_fn: str, config: dict[str, Any]) -> Any:
    """The loss the request names, built with its arguments; ``BadRequest`` names what is wrong."""
    if LOSS_KEY in config:
        name = config[LOSS_KEY]
        args = {k: v for k, v in config.items() if k not in (LOSS_KEY, "twinkle_reduction")}
    else:
        name = "DPOLoss"
        args = {UPSTREAM_DPO[k]: v for k, v in config.items() if k in UPSTREAM_DPO}
    loss = construct(name, args)
    if getattr(loss, "consumes", None) != "rows" or loss.require_logits or loss.require_entropy:
        raise BadRequest(
            f"loss_fn_config: {name} with these arguments needs the logits or their entropy, not only "
            "the targets' log-probabilities; the server computes it from log-probabilities only"
        )
    return loss


def construct(name: str, args: dict[str, Any]) -> Any:
    """``twinkle.loss.LOSSES[name](**args)``, each argument checked against the constructor's
    signature; ``BadRequest`` names an unknown loss, an argument it does not take, a bad value."""
    from twinkle.loss.registry import LOSSES
    from twinkle.utils.errors import UserError

    if name not in LOSSES:
        raise BadRequest(f"loss_fn_config[{LOSS_KEY!r}]: unknown loss {name!r}; valid: {', '.join(LOSSES)}")
    cls = LOSSES[name]
    params = inspect.signature(cls).parameters
    unknown = sorted(k for k in args if k not in params)
    if unknown:
        raise BadRequest(f"loss_fn_config: {name} takes no argument {', '.join(map(repr, unknown))}")
    args = {k: _typed(v, params[k]) for k, v in args.items()}
    try:
        return cls(**args)
    except (UserError, TypeError, ValueError) as exc:
        raise BadRequest(f"loss_fn_config: {exc}") from None


def _typed(value: Any, param: inspect.Parameter) -> Any:
    """A float that is a whole number, for an argument whose default is an int or a bool, or
    that is annotated ``int | None`` (``GKDLoss(topk=)``, ``InfonceLoss(hard_negatives=)``)."""
    default = param.default
    if isinstance(value, float) and isinstance(default, bool):
        return bool(value)
    whole = isinstance(value, float) and value.is_integer()
    if whole and (isinstance(default, int) or int in typing.get_args(param.annotation)):
        return int(value)
    return value


def check_inputs(loss: Any, data: list[Datum]) -> None:
    """Every datum carries ``weights`` and each input the loss declares."""
    needed = ["weights"] + [k for k, v in STEP_INPUTS.items() if v in loss.extra_inputs]
    for i, d in enumerate(data):
        missing = [k for k in needed if k not in d.inputs]
        if missing:
            raise BadRequest(
                f"datum {i}: loss_fn_inputs lacks {', '.join(map(repr, missing))} ({loss.name} needs them)"
            )
        extra = sorted(set(d.inputs) - set(needed) - {"target_tokens"})
        if extra:
            raise BadRequest(
                f"datum {i}: loss_fn_inputs {', '.join(map(repr, extra))} is not read by {loss.name}"
            )


def per_label(data: list[Datum], values: list[np.ndarray], fill: float) -> torch.Tensor:
    """(B, L + 1) rows of per-token values aligned with twinkle's labels (``[fill] + values``)."""
    width = max(d.tokens.size for d in data) + 1
    out = torch.full((len(data), width), fill, dtype=torch.float32)
    for b, v in enumerate(values):
        out[b, 1 : 1 + v.size] = torch.from_numpy(v.astype(np.float32))
    return out


def labels_of(data: list[Datum]) -> torch.Tensor:
    """(B, L + 1) twinkle labels of the datums: the target where the weight is not 0, else -100."""
    mask = per_label(data, [d.inputs["weights"] != 0 for d in data], 0.0) != 0
    targets = per_label(data, [d.inputs["target_tokens"].astype(np.float32) for d in data], IGNORE)
    return torch.where(mask, targets.long(), torch.full_like(targets, IGNORE).long())


def objective(loss: Any, data: list[Datum], logps: list[np.ndarray]) -> tuple[float, int, list[np.ndarray]]:
    """(summed loss, its count, ``-dC/dlogp`` per datum) at the policy's log-probs ``logps``."""
    from twinkle.loss.base import rows_view_of

    labels = labels_of(data)
    policy = per_label(data, logps, 0.0).requires_grad_(True)
    batch: dict[str, Any] = {"labels": labels}
    for wire, name in STEP_INPUTS.items():
        if name in loss.extra_inputs:
            batch[name] = per_label(data, [d.inputs[wire] for d in data], 0.0)
    batch = loss.upstream_batch(batch, {"logps": policy})
    out = loss.compute(rows_view_of(loss, batch, {"logps": policy}))
    (grad,) = torch.autograd.grad(out.loss_sum, policy, allow_unused=True)
    grad = torch.zeros_like(policy) if grad is None else grad
    weights = [(-grad[b, 1 : 1 + d.tokens.size]).numpy() for b, d in enumerate(data)]
    return float(out.loss_sum.detach()), max(1, int(out.num_tokens)), weights


def run(
    core: Any, adapter: str, data: list[Datum], loss: Any, forward_only: bool, window: "Window | None" = None
) -> tuple[list, dict]:
    """The composite step on ``core`` (a ``ModelCore`` or its proxy): per datum its targets'
    ``logprobs``; metrics ``loss:sum``, ``loss:mean`` and ``num_tokens:sum`` (the loss's count),
    and a preference loss's pair metrics (``pair_metric``). A training call (not
    ``forward_only``) adds its loss and pairs to ``window`` once its backward has run."""
    plain = [
        Datum(
            d.tokens,
            {"target_tokens": d.inputs["target_tokens"], "weights": d.inputs["weights"]},
            vision=d.vision,
        )
        for d in data
    ]
    outs, _ = core.run_datums(adapter, plain, "cross_entropy", {}, True)
    logps = [np.asarray(o["logprobs"], dtype=np.float32) for o in outs]
    total, count, weights = objective(loss, data, logps)
    if not forward_only:
        weighted = [
            Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "weights": w}, vision=d.vision)
            for d, w in zip(data, weights, strict=True)
        ]
        config = {"twinkle_reduction": "token_mean", COUNT_KEY: float(count)}
        core.run_datums(adapter, weighted, "cross_entropy", config, False)
    metrics = {"loss:sum": total, "loss:mean": total / count, "num_tokens:sum": float(count)}
    pairs = pair_metric(loss, data, logps)
    if pairs is not None:
        metrics |= {name + SUFFIX.get(name, ":mean"): value for name, value in pairs.calculate().items()}
    if window is not None and not forward_only:
        window.add(loss, total, count, data, logps)
    return [{"logprobs": lp} for lp in logps], metrics


SUFFIX = {"pairs": ":sum"}  # how the SDK combines each pair metric over a request's chunks


def pair_metric(loss: Any, data: list[Datum], logps: list[np.ndarray], into: Any = None) -> Any:
    """``DPOMetric`` (``into``, or a new one at the loss's ``beta``) having seen the call's pairs
    (rows ``2i``, ``2i + 1``: chosen, rejected; the reference's rewards when the loss reads
    ``ref_logps``); None for a loss that is not a preference loss or fewer than 2 datums."""
    from twinkle.loss.preference import PreferenceLoss

    if not isinstance(loss, PreferenceLoss) or len(data) < 2:
        return None
    metric = into if into is not None else ServerDPOMetric(beta=getattr(loss, "beta", 0.1))
    metric.beta = float(getattr(loss, "beta", metric.beta))  # the rewards at this call's beta
    outputs = {"logps": per_label(data, logps, 0.0)}
    if "ref_logps" in loss.extra_inputs:
        outputs["ref_logps"] = per_label(data, [d.inputs["ref_logps"] for d in data], 0.0)
    metric.accumulate({"labels": labels_of(data)}, outputs)
    return metric


class ServerDPOMetric(DPOMetric):
    """``DPOMetric`` over datums the server holds whole: nothing to gather from other ranks."""

    def gather_results(self, local_results: list[Any]) -> list[Any]:
        return list(local_results)


class Window:
    """A run's composite training calls since its last ``optim_step``, which reports them: the
    mean ``loss`` over the losses' counts (pairs for a preference loss, tokens otherwise) and, for a
    preference loss, ``DPOMetric``'s numbers over the window's pairs (``chosen_logps``,
    ``rejected_logps``, ``chosen_reward``, ``rejected_reward``, ``reward_margin``,
    ``reward_accuracy``, ``pairs``), as the local ``calculate_metric`` reports them."""

    def __init__(self) -> None:
        self.total, self.count, self.pairs = 0.0, 0, None

    def add(self, loss: Any, total: float, count: int, data: list[Datum], logps: list[np.ndarray]) -> None:
        self.total += total
        self.count += count
        self.pairs = pair_metric(loss, data, logps, into=self.pairs) or self.pairs

    def report(self) -> dict[str, float]:
        out = {"loss": self.total / self.count} if self.count else {}
        if self.pairs is not None:
            out |= {k: float(v) for k, v in self.pairs.calculate().items()}
        return out


# the loss_fn_config keys each Tinker loss honours (besides those of every request, ``COMMON``)
TINKER_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
}
COMMON = ("twinkle_reduction", "disable_lora")


def check_config(loss_fn: str, config: dict[str, Any], forward_only: bool, composite: bool) -> None:
    """Every ``loss_fn_config`` key is one the request's loss honours; ``BadRequest`` names the
    first that is not (a key the server would otherwise ignore). A composite loss's own
    arguments are checked against its signature when it is built (``build``)."""
    if COUNT_KEY in config:
        raise BadRequest(f"loss_fn_config[{COUNT_KEY!r}] is the server's own; leave it out")
    if config.get("disable_lora") and not forward_only:
        raise BadRequest(
            "loss_fn_config['disable_lora'] is for forward (a reference pass over the base model); "
            "a forward_backward with the adapter off would train nothing"
        )
    if config.get("disable_lora") and composite:
        raise BadRequest("loss_fn_config['disable_lora'] takes the cross_entropy loss (it returns log-probs)")
    if composite:
        if LOSS_KEY not in config:
            extra = sorted(set(config) - set(UPSTREAM_DPO) - set(COMMON))
            if extra:
                raise BadRequest(
                    f"loss_fn_config key {extra[0]!r} is not read by the DPO loss of importance_sampling with "
                    f"ref_logps; it reads {', '.join(UPSTREAM_DPO)}"
                )
        if config.get("twinkle_reduction", "token_mean") != "token_mean":
            raise BadRequest(
                "loss_fn_config['twinkle_reduction']: a twinkle loss is averaged by its own count"
            )
        return
    honoured = TINKER_KEYS.get(loss_fn, ()) + COMMON
    extra = sorted(set(config) - set(honoured))
    if extra:
        raise BadRequest(
            f"loss_fn_config key {extra[0]!r} is not read by loss_fn {loss_fn!r}; it reads "
            f"{', '.join(honoured)}"
        )
