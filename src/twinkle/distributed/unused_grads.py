"""Under FSDP2, a trainable weight of a decoder layer that some ranks' micro-batches used and
others' left unused gets a zero gradient on the others.

FSDP2 reduces a unit's gradients in one collective over the weights that have one on that rank.
A weight only some ranks used (data-dependent control flow: DeepSeek-V4's compressor forms no
block from rows shorter than its compression rate, so its projection's output is dropped there)
would make the ranks send buffers of different sizes, and the job would stop in the collective.
``fill_unused_grads`` hooks each layer: after its forward, the weights its output's autograd
graph reaches are this rank's used ones; the ranks OR them (a few bytes over a gloo group, so no
device synchronises), and an identity put in front of the layer's hidden states gives, in its
backward, a zero gradient to each weight another rank used and this one did not. A weight no
rank used keeps none, as in one process (AdamW skips it there, where a zero gradient would decay
it), and an idle adapter's weights cost nothing."""

from typing import Any

import torch
import torch.distributed as dist

ATTRIBUTE = "_twinkle_fills_unused_grads"


class _Pending:
    """One layer call's trainable weights, the identity's node, and which weights to fill."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.node: Any = None
        self.fill: list[bool] | None = None


class _FillUnused(torch.autograd.Function):
    """Identity on ``hidden``; its backward gives a zero gradient to each of ``params`` that
    ``pending.fill`` marks (decided after the layer's forward)."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.pending = pending
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pending = ctx.pending
        fill = pending.fill or [False] * len(pending.params)
        zeros = tuple(
            torch.zeros(p.shape, dtype=p.dtype, device=p.device) if f else None
            for p, f in zip(pending.params, fill, strict=True)
        )
        return (None, grad, *zeros)


def _reached(outputs: Any) -> set[int]:
    """The ids of the leaf tensors (weights) the autograd graph of ``outputs`` reaches, walking
    back no further than a layer's identity node (this layer's input, or an earlier layer's)."""
    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    stack = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    leaves: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "_FillUnusedBackward":
            continue
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            leaves.add(id(variable))
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _hooks(group: Any) -> tuple[Any, Any]:
    def pre_hook(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        layer.__dict__.pop("_twinkle_pending", None)
        if not torch.is_grad_enabled():
            return None
        params = [p for p in layer.parameters() if p.requires_grad]
        if not params:
            return None
        pending = _Pending(params)
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            args = (_FillUnused.apply(pending, args[0], *params), *args[1:])
        elif (
            isinstance(kwargs.get("hidden_states"), torch.Tensor)
            and kwargs["hidden_states"].is_floating_point()
        ):
            kwargs = {**kwargs, "hidden_states": _FillUnused.apply(pending, kwargs["hidden_states"], *params)}
        else:
            return None
        layer.__dict__["_twinkle_pending"] = pending
        return args, kwargs

    def post_hook(layer: torch.nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        pending = layer.__dict__.pop("_twinkle_pending", None)
        if pending is None:
            return
        used = _reached(outputs)
        mine = [id(p) in used for p in pending.params]
        some = torch.tensor(mine, dtype=torch.uint8)
        dist.all_reduce(some, op=dist.ReduceOp.MAX, group=group)
        pending.fill = [bool(s) and not m for s, m in zip(some.tolist(), mine, strict=True)]

    return pre_hook, post_hook


def fill_unused_grads(layers: list[torch.nn.Module]) -> None:
    """Install the hooks on each of ``layers`` (FSDP2's units). Every rank calls this, as it
    creates a gloo group over all ranks where the default backend is another. Call it after
    ``fully_shard``: the pre-hook then runs after FSDP2's, on the gathered weights."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    pre_hook, post_hook = _hooks(group)
    for layer in layers:
        if not getattr(layer, ATTRIBUTE, False):
            layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
            layer.register_forward_hook(post_hook, with_kwargs=True)
            setattr(layer, ATTRIBUTE, True)
