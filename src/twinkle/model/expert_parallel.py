"""Expert parallelism in ``TransformersModel`` (``DeviceMesh(ep_size=N)``, upstream's
``fsdp_config={'expert_parallel': {'enabled': True, ...}}``).

For the families whose experts transformers keeps as fused 3-D weights behind one call,
``experts(hidden, top_k_index, top_k_weights)`` (``FAMILIES``): each rank keeps the
``ep_rank``-th of N contiguous blocks of every MoE layer's experts (``gate_up_proj`` and
``down_proj``, and gpt-oss's ``gate_up_proj_bias`` and ``down_proj_bias``, sliced along the
expert dimension when the model is placed, once its adapters are attached), and the experts'
forward on this instance is replaced by an exchange (``twinkle.distributed.expert_parallel``):
each (token, chosen expert) pair is sent to the rank of the exchange group that holds the
expert, run there as the family runs it (its weight layout and biases, ``_project``; its own
activation, ``gated``), sent back, weighted and summed in the family's order (ascending expert).
The router, its routing weights (the family's softmax, renormalised where the family does) and
its logits, hence the auxiliary loss computed from them, are the family's own and run on every
rank's own tokens.

FSDP2 shards every other weight as before; the expert blocks are left out of its units
(``ignored_params``), so they are never gathered. With an adapter the experts' own weights are
frozen, so the ranks that hold the same block keep the same weights. LoRA on the experts (PEFT's
``target_parameters``, or ``'all-linear'``, which PEFT maps onto them) is made over all the
experts before the split, so its weights, their initialisation and the saved adapter are one
process's; FSDP2 shards them like any LoRA weight, and each rank adds only its block's update
(``_block_updates``). A LoRA weight's gradient is then nonzero only in the blocks of the
experts a rank holds, with every token routed to them; FSDP2's reduction over all ranks sums
each expert's tokens over the ranks that hold it, as one process does. Without an adapter
(full-parameter training) each rank trains its blocks (``twinkle.model.expert_parallel_full``);
an expert's own weight trained beside an adapter is refused in one line (``check_trainable``).

One line each, before the weights load where the model is a local folder: a model without
experts, N not dividing the expert count, a family not in ``FAMILIES``, an ``expert_parallel``
option other than upstream's.

Ulysses sequence parallelism (``twinkle.model.ulysses``) combines with it: each rank runs its
share of the positions through the layers, and the MoE layers act on each token alone (the
router, then the token's chosen experts, wherever they are held), so the exchange over each
rank's own tokens computes what one process does. Both kinds of groups are made by every rank,
each from the mesh's own coordinates (``ulysses`` and ``ep``); a rank's Ulysses peers need not
hold its experts.

Routing replay (``twinkle.model.router_replay``) runs under expert parallelism unchanged: its
hooks replace each router's output on the rank's own tokens, before the MoE block calls the
experts, so the exchange dispatches by the replayed global expert ids as it would by the
router's own."""

import json
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.distributed.expert_parallel import ExpertGroup, exchange_counts, exchange_rows, expert_group
from twinkle.distributed.mesh import DeviceMesh
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()

ATTRIBUTE = "_twinkle_expert_parallel"
# model types whose MoE block calls experts(hidden, top_k_index, top_k_weights) on fused 3-D
# gate_up_proj and down_proj: (experts, out, in), or (experts, in, out) where transformers marks
# the experts ``is_transposed`` (gpt-oss, whose experts also carry ``*_proj_bias``)
FAMILIES = (
    "qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3", "deepseek_v4",
    "gpt_oss",
)  # fmt: skip
# an experts module's own weights: split into blocks, left out of FSDP2, never trained
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")
OPTION_KEYS = ("enabled", "router_dtype", "keep_router_logits", "ep_size")


def resolve_options(fsdp_config: dict[str, Any] | None, ep_size: int) -> bool:
    """Whether expert parallelism runs, from the mesh's ``ep_size`` and upstream's
    ``fsdp_config['expert_parallel']`` (``enabled``, ``router_dtype``, ``keep_router_logits``,
    ``ep_size``). The router is the family's, whose probabilities are fp32 (``router_dtype``
    'fp32' only) and whose logits the model returns as it does without EP (either
    ``keep_router_logits``)."""
    value = (fsdp_config or {}).get("expert_parallel")
    if value is None:
        return ep_size > 1
    if isinstance(value, bool):
        value = {"enabled": value}
    if not isinstance(value, dict):
        raise UserError(f"fsdp_config['expert_parallel'] must be a dict of options, got {value!r}")
    unknown = sorted(set(value) - set(OPTION_KEYS))
    if unknown:
        raise UserError(
            f"fsdp_config['expert_parallel'] keys {unknown} are not supported here; supported: "
            f"{', '.join(OPTION_KEYS)}"
        )
    if value.get("router_dtype", "fp32") != "fp32":
        raise UserError(
            f"fsdp_config['expert_parallel']['router_dtype']={value['router_dtype']!r}: the router here is "
            "the model's own, whose softmax runs in fp32; use 'fp32'"
        )
    if value.get("ep_size") not in (None, ep_size):
        raise UserError(
            f"fsdp_config['expert_parallel']['ep_size']={value['ep_size']} but the mesh has ep_size={ep_size}; "
            "give the size to the mesh (DeviceMesh.from_sizes(..., ep_size=...))"
        )
    enabled = bool(value.get("enabled", True))
    if enabled and ep_size == 1:
        logger.warning(
            "fsdp_config['expert_parallel'] is enabled but the mesh has ep_size=1: every rank holds every "
            "expert (DeviceMesh.from_sizes(..., ep_size=N) splits them)"
        )
    if not enabled and ep_size > 1:
        logger.warning(
            f"the mesh has ep_size={ep_size} but fsdp_config['expert_parallel'] is disabled: FSDP2 shards the "
            "experts with the rest of the model"
        )
    return enabled and ep_size > 1


def _experts_of(config: Any) -> tuple[str | None, int]:
    text = getattr(config, "text_config", None) or config
    if isinstance(text, dict):
        text = types.SimpleNamespace(**text)
    kind = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    # transformers saves num_experts as num_local_experts (the config's attribute map);
    # DeepSeek-V3's config.json names them n_routed_experts
    experts = (
        getattr(text, "num_experts", None)
        or getattr(text, "num_local_experts", None)
        or getattr(text, "n_routed_experts", None)
    )
    return kind, int(experts or 0)


def check_model(config: Any, size: int) -> None:
    """One line for a model expert parallelism cannot split ``size`` ways."""
    kind, experts = _experts_of(config)
    if not experts:
        raise UserError(f"ep_size={size}: {kind} is a dense model (no experts to split); use ep_size=1")
    if kind not in FAMILIES:
        raise UserError(
            f"ep_size={size} runs the families {', '.join(FAMILIES)}; {kind} is not one of them; use ep_size=1"
        )
    if experts % size:
        raise UserError(
            f"ep_size={size} does not divide the model's {experts} experts (num_experts); each rank holds "
            "num_experts / ep_size of them"
        )


def check_folder(model_id: Any, config: Any, size: int) -> None:
    """``check_model`` before any weight loads, on ``config`` or a local folder's
    ``config.json``. Routing replay and Ulysses combine as they are, so nothing here depends on
    them: replay rewrites each router's top-k choice on the rank's
    own tokens, and the exchange then sends each token to the rank holding the replayed (global)
    expert id; under Ulysses a rank's own tokens are its share of the positions, and the router,
    the experts and their exchange act on each token alone. What either refuses on its own (a
    model replay cannot hook, heads Ulysses cannot split) is said by that one."""
    if size == 1:
        return
    if config is None:
        path = Path(str(model_id)) / "config.json" if model_id is not None else None
        if path is None or not path.is_file():
            return
        try:
            config = types.SimpleNamespace(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return  # the loader says what is wrong with the folder
    check_model(config, size)


class ExpertParallel:
    """A model's exchange group and its MoE layers' experts modules; ``split`` keeps this rank's
    block of them once the adapters are attached."""

    def __init__(
        self, group: ExpertGroup, modules: list[torch.nn.Module], experts: int, device: torch.device
    ):
        self.group = group
        self.modules = modules
        self.experts = experts
        self.device = device
        self.params: list[torch.nn.Parameter] = []  # this rank's expert blocks, once split

    @property
    def block(self) -> tuple[int, int]:
        """The experts this rank holds: ``range(*block)``."""
        local = self.experts // self.group.size
        return self.group.rank * local, (self.group.rank + 1) * local

    def check_trainable(self, model: torch.nn.Module) -> None:
        """One line when an expert's own weight would train beside LoRA adapters. Without an
        adapter (full-parameter training) every rank trains its block of the experts
        (``twinkle.model.expert_parallel_full``); with one, the optimizer keeps whole copies of
        the trainable weights, which a block is not."""
        for name, param in model.named_parameters():
            if ".base_layer" not in name or not param.requires_grad:
                continue
            if name.replace(".base_layer", "").endswith((".experts.gate_up_proj", ".experts.down_proj")):
                raise UserError(
                    f"ep_size={self.group.size}: {name} would train beside a LoRA adapter; under expert "
                    "parallelism the experts' own weights train only without adapters (full-parameter "
                    "training); keep them frozen, or build the model without add_adapter_to_model"
                )

    def split(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """Keep this rank's block of every MoE layer's experts, exchange tokens in their forward,
        and make each expert LoRA (PEFT's ``ParamWrapper`` on ``gate_up_proj``/``down_proj``, made
        over all the experts, so its weights and their initialisation are one process's) add only
        its block's update. Returns the expert blocks, which FSDP2 leaves out. Called on every
        placement (each adapter added); the experts are split once."""
        self.check_trainable(model)
        start, end = self.block
        if not self.params:
            for module in self.modules:
                for name in (*EXPERT_WEIGHTS, *EXPERT_BIASES):
                    if isinstance(getattr(module, name, None), torch.nn.Parameter):
                        self.params.append(_keep_block(module, name, start, end, self.device))
                module.forward = types.MethodType(_exchanging_forward(self.group, self.experts), module)
            logger.info(f"expert parallelism: experts {start}..{end - 1} of {self.experts} on this rank")
        owned = {id(m) for m in self.modules}
        for wrapper in model.modules():
            if not hasattr(wrapper, "get_delta_factors") or id(wrapper.get_base_layer()) not in owned:
                continue
            if getattr(wrapper, "num_experts", None) != self.experts:
                raise UserError(
                    f"ep_size={self.group.size}: LoRA on the experts must be attached before the experts are split "
                    "(the first adapter); add the adapters that reach the experts first"
                )
            if not getattr(wrapper, "_twinkle_block", None):
                _block_updates(wrapper, start, end)
        return set(self.params)


def _block_updates(wrapper: Any, start: int, end: int) -> None:
    """``wrapper`` (a PEFT ``ParamWrapper`` over all the experts) adds only the update of experts
    ``start..end - 1``: its factors sliced along the expert dimension, before the product.
    Under FSDP2 its LoRA weights are whole in the forward; the gradient of each rank's block
    reaches the other ranks through FSDP2's reduction, which sums each expert's tokens over the
    ranks that hold it."""
    full_factors = wrapper.get_delta_factors

    def get_delta_factors(adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        lhs, rhs, scaling = full_factors(adapter_name)
        return lhs[start:end], rhs[start:end], scaling

    def get_delta_weight(adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        lhs, rhs, scaling = get_delta_factors(adapter_name)
        param = wrapper.get_param()
        return (torch.bmm(lhs, rhs) * scaling).to(param.device, param.dtype)

    wrapper.get_delta_factors = get_delta_factors
    wrapper.get_delta_weight = get_delta_weight
    wrapper._twinkle_block = (start, end)


def _expert_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    found = []
    for module in lm.modules():
        weights = [getattr(module, name, None) for name in EXPERT_WEIGHTS]
        if all(isinstance(w, torch.nn.Parameter) and w.dim() == 3 for w in weights):
            found.append(module)
    return found


def _keep_block(module: torch.nn.Module, name: str, start: int, end: int, device: torch.device) -> Any:
    full = getattr(module, name)
    block = torch.nn.Parameter(full.detach()[start:end].to(device).clone(), requires_grad=full.requires_grad)
    setattr(module, name, block)
    return block


def install(lm: Any, mesh: DeviceMesh, rank: int, device: torch.device, checkpointing: Any) -> ExpertParallel:
    """Set up expert parallelism on ``lm`` (a ``*ForCausalLM``, before adapters and sharding) over
    ``mesh``'s expert groups; ``ExpertParallel.split`` then keeps this rank's experts when the
    model is placed. Every rank calls it (it creates the process groups). Activation
    checkpointing left to ``auto`` is turned off: a rank recomputing a layer in the backward
    exchanges tokens again, so every rank must decide alike (``on`` does)."""
    size = mesh.ep_size
    check_model(lm.config, size)
    modules = _expert_modules(lm)
    if not modules:
        raise UserError(
            f"ep_size={size}: no module of {type(lm).__name__} holds fused expert weights (gate_up_proj, down_proj)"
        )
    ep = ExpertParallel(expert_group(mesh, rank), modules, modules[0].gate_up_proj.shape[0], device)
    setattr(lm, ATTRIBUTE, ep)
    if checkpointing.mode == "auto":
        checkpointing.mode = "off"
        logger.warning(
            "ep_size=%d: activation checkpointing 'auto' is off (each rank would decide alone, and a "
            "recomputed layer exchanges tokens again); activation_checkpointing='on' recomputes every layer",
            size,
        )
    return ep


def _project(experts: torch.nn.Module, x: torch.Tensor, name: str, j: int) -> torch.Tensor:
    """``x`` through local expert ``j``'s ``name`` projection as the family computes it: ``x @ W``
    on the transposed layout (experts, in, out), ``x @ W.T`` on (experts, out, in); plus the
    expert's bias where the family has one (``has_bias``: gpt-oss)."""
    weight = getattr(experts, name)[j]
    out = x @ weight if getattr(experts, "is_transposed", False) else F.linear(x, weight)
    if getattr(experts, "has_bias", False):
        out = out + getattr(experts, name + "_bias")[j]
    return out


def gated(experts: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The experts' activation on ``gate_up`` (an expert's ``gate_up_proj`` product): the
    family's own ``_apply_gate`` where it has one (DeepSeek-V4 clamps gate and up to
    ``swiglu_limit`` before its SwiGLU; gpt-oss clamps interleaved gate/up columns and computes
    ``(up + 1) * gate * sigmoid(alpha * gate)``), else the plain SwiGLU on the two halves."""
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _exchanging_forward(eg: ExpertGroup, experts: int) -> Any:
    local = experts // eg.size

    def forward(
        self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        chosen = top_k_index.reshape(-1)
        # (token, expert) pairs by ascending expert, so by owner; in token order within an expert
        order = chosen.argsort(stable=True)
        token = order // top_k
        per_expert = torch.bincount(chosen, minlength=experts).view(eg.size, local)
        # row j: how many rows of each of its local experts rank j sends here
        incoming = exchange_counts(per_expert, eg)
        send, receive = per_expert.sum(1).tolist(), incoming.sum(1).tolist()
        rows = exchange_rows(hidden[token], send, receive, eg)
        # the received rows by local expert (each sender's are sorted already)
        which = torch.arange(local, device=rows.device).repeat(eg.size)
        by_expert = torch.repeat_interleave(which, incoming.reshape(-1).to(rows.device)).argsort(stable=True)
        counts = incoming.sum(0).tolist()
        # every local expert runs, on no rows where none came: the backward then runs the same
        # collectives on every rank (a rank that received nothing still sends its empty gradient
        # back through the first exchange) and every expert weight, and its LoRA, gets a gradient
        # (zero), so FSDP2 reduces the same tensors on every rank
        outputs = []
        for j, part in enumerate(rows[by_expert].split(counts)):
            up = gated(self, _project(self, part, "gate_up_proj", j))
            outputs.append(_project(self, up, "down_proj", j))
        done = torch.cat(outputs)
        back = exchange_rows(done[by_expert.argsort()], receive, send, eg)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden)
        return out.index_add_(0, token, weighted.to(out.dtype))

    return forward


def expert_parallel_of(lm: Any) -> ExpertParallel | None:
    """The expert parallelism set up on ``lm`` (a ``*ForCausalLM``), or None."""
    return getattr(lm, ATTRIBUTE, None)
