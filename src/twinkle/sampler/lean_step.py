"""A decoding step of a Llama-family model written out layer by layer, without the model's forward.

One new token per row is a small amount of arithmetic: at batch 1 a step's time is the time its
weights take to stream from memory, once each, while the model's own forward spends about as long
again in Python around the products (keyword plumbing, mask building, a cache appended to by
concatenation). ``LeanStep`` calls the same modules' ``forward`` methods in the same order
(norms, projections, the model's own rotary embedding and ``apply_rotary_pos_emb``), attends with
``scaled_dot_product_attention`` over a cache written in place (``LeanCache``), and returns the
last position's logits: the same operations, so the same numbers up to the attention kernel's
summation order. Each step walks call op ``decode_step``'s chain (``registry.dispatch``): where
its C kernel takes the model (fp32 weights, norms that scale by their weight, SiLU gates), the
work between the products (residual adds and norms, rotation, cache write, attention, gate) runs
there (backend ``native``), three calls a layer in place of about forty torch ops: the same
arithmetic in another summation order (about 1e-6 relative); else the modules run it (``torch``).

It applies to models whose decoder it reproduces exactly (``LEAN_TYPES``: a causal self-attention
with rotary embeddings, an MLP of gate, up and down projections, RMS norms) with every projection
a plain ``nn.Linear`` or a PEFT LoRA layer over one (``project``: a plain-LoRA call as its three
linear layers, any other as the layer's own forward) and no module hooks; anything else
(FSDP-sharded modules, sliding windows, another family) decodes through the model's forward
(``lean_step`` returns None). The prompt's prefill always runs the model's forward."""

import sys
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from twinkle.kernel import decode_step, registry
from twinkle.kernel.lora.linear import draw_drop, fusable

LEAN_TYPES = ("llama", "mistral", "qwen2")
SILU = ("SiLU", "SiLUActivation")  # torch's module, transformers' ("silu")
GROW = 64  # cache positions added at a time (one copy of the cache per 64 steps)


class LeanCache:
    """Keys and values of each layer, ``(rows, kv_heads, capacity, head_dim)``, the first
    ``length`` positions filled; made from the prefill's ``DynamicCache``."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.length = keys[0].shape[2]
        self._grow()

    @classmethod
    def of(cls, cache: Any) -> "LeanCache":
        return cls([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    def _grow(self) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:2], GROW, t.shape[3])], dim=2)

        self.keys = [grown(t) for t in self.keys]
        self.values = [grown(t) for t in self.values]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new position's ``(rows, kv_heads, 1, head_dim)`` key and value; the layer's
        keys and values so far."""
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.length : self.length + 1] = key
        values[:, :, self.length : self.length + 1] = value
        return keys[:, :, : self.length + 1], values[:, :, : self.length + 1]

    def advance(self) -> None:
        self.length += 1
        if self.length == self.keys[0].shape[2]:
            self._grow()

    def select(self, index: torch.Tensor) -> None:
        self.keys = [t.index_select(0, index) for t in self.keys]
        self.values = [t.index_select(0, index) for t in self.values]


class LeanStep:
    """The decoding step of ``lm`` (see the module docstring)."""

    def __init__(self, lm: Any):
        self.lm, self.inner = lm, lm.model
        self.layers = list(self.inner.layers)
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.native = _native_fits(lm, self.layers, self.head_dim)

    @torch.no_grad()
    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: LeanCache, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``ids``/``positions`` ``(rows, 1)``; ``mask`` ``(rows, cached + 1)`` (1: attend) or None.
        The new position's fp32 logits ``(rows, vocab)``, by the first backend of call op
        ``decode_step``'s chain that takes the step."""
        return registry.dispatch(decode_step.OP, _RUN, self, ids, positions, cache, mask)

    def _modules(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: LeanCache, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Backend ``torch``: the step through the model's own modules and SDPA, one by one."""
        rows = ids.shape[0]
        hidden = self.inner.embed_tokens.forward(ids)
        cos, sin = self.inner.rotary_emb.forward(hidden, positions)
        attn_mask = None if mask is None else mask[:, None, None, :].bool()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm.forward(hidden)
            q = project(attn.q_proj, x).view(rows, 1, -1, self.head_dim).transpose(1, 2)
            k = project(attn.k_proj, x).view(rows, 1, -1, self.head_dim).transpose(1, 2)
            v = project(attn.v_proj, x).view(rows, 1, -1, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            keys, values = cache.write(i, k, v)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=attn_mask, scale=self.scaling, enable_gqa=True
            )
            hidden = hidden + project(attn.o_proj, out.transpose(1, 2).reshape(rows, 1, -1))
            x = layer.post_attention_layernorm.forward(hidden)
            mlp = layer.mlp
            x = mlp.act_fn(project(mlp.gate_proj, x)) * project(mlp.up_proj, x)
            hidden = hidden + project(mlp.down_proj, x)
        cache.advance()
        hidden = self.inner.norm.forward(hidden)
        return project(self.lm.lm_head, hidden)[:, -1].float()

    def _native(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: LeanCache, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Backend ``native``: the same step with the work between the products in
        ``kernel/decode_step.c`` (each layer's residual add and norm, rotation, cache write and
        attention, and gate); None where the kernel does not compute this model or is not usable."""
        if not (self.native and decode_step.enabled()):
            return None
        rows = ids.shape[0]
        hidden = self.inner.embed_tokens.forward(ids)
        cos, sin = (
            t.reshape(rows, -1).contiguous() for t in self.inner.rotary_emb.forward(hidden, positions)
        )
        hidden = hidden.reshape(rows, -1).clone()
        keep = None if mask is None else mask.to(torch.int64).contiguous()
        x = torch.empty_like(hidden)
        added = None
        for i, layer in enumerate(self.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            decode_step.add_rms_norm(hidden, added, norm.weight, norm.variance_epsilon, x)
            q, k, v = (project(p, x).contiguous() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = decode_step.attention(
                q, k, v, cos, sin, cache.keys[i], cache.values[i], cache.length, keep, self.scaling
            )
            norm = layer.post_attention_layernorm
            decode_step.add_rms_norm(hidden, project(attn.o_proj, out), norm.weight, norm.variance_epsilon, x)
            gate = decode_step.silu_mul(
                project(mlp.gate_proj, x).contiguous(), project(mlp.up_proj, x).contiguous()
            )
            added = project(mlp.down_proj, gate).contiguous()
        cache.advance()
        norm = self.inner.norm
        decode_step.add_rms_norm(hidden, added, norm.weight, norm.variance_epsilon, x)
        return project(self.lm.lm_head, x).float()


_RUN = {"native": LeanStep._native, "torch": LeanStep._modules}


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output for ``x``. A LoRA layer whose call is plain LoRA (one adapter, no
    dropout drawn) computes ``base(x) + scaling * B(A(x))`` from its three plain linear layers'
    own forwards, which a sampler routes to the decoding products (``sampler/linears.py``); the
    fused LoRA node would take oneDNN's blocked product, built for training's hundreds of rows.
    Any other module runs its forward."""
    if isinstance(module, LoraLayer):
        name = fusable(module, x, (), {})
        if name is not None and draw_drop(module, name) is None:
            out = module.base_layer.forward(x)
            low = module.lora_A[name].forward(x.to(module.lora_A[name].weight.dtype))
            return out + (module.lora_B[name].forward(low) * module.scaling[name]).to(out.dtype)
    return module.forward(x)


def _linear_or_lora(module: Any) -> bool:
    """A plain ``nn.Linear``, or a PEFT LoRA layer over one (its forward, or ``project``'s)."""
    if isinstance(module, LoraLayer):
        return isinstance(getattr(module, "base_layer", None), nn.Linear)
    return isinstance(module, nn.Linear)


def _native_fits(lm: Any, layers: list[Any], head_dim: int) -> bool:
    """Whether ``kernel/decode_step.c`` computes ``lm``'s layers: fp32 weights, RMS norms that
    scale by their weight, SiLU gates, an even head dimension."""
    norms = [lm.model.norm] + [
        n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    return (
        head_dim % 2 == 0
        and all(p.dtype == torch.float32 for p in lm.parameters())
        and all(
            isinstance(getattr(n, "variance_epsilon", None), float) and n.weight.is_contiguous()
            for n in norms
        )
        and all(type(layer.mlp.act_fn).__name__ in SILU for layer in layers)
    )


def lean_step(lm: Any) -> LeanStep | None:
    """A ``LeanStep`` for ``lm`` when it reproduces ``lm``'s decoding step, else None."""
    cfg = getattr(lm, "config", None)
    inner = getattr(lm, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in LEAN_TYPES or inner is None:
        return None
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return None
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb") or not hasattr(lm, "lm_head"):
        return None
    for module in lm.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return None
        if isinstance(module, nn.Linear) and (
            type(module) is not nn.Linear or hasattr(module.weight, "full_tensor")
        ):
            return None
        if any(p.device.type != "cpu" for p in module.parameters(recurse=False)):
            return None
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(_linear_or_lora(getattr(attn, n, None)) for n in names):
            return None
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):  # qwen3-style norms: not reproduced
            return None
        if not all(_linear_or_lora(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            return None
    module = sys.modules.get(type(inner.layers[0].self_attn).__module__)
    return LeanStep(lm) if hasattr(module, "apply_rotary_pos_emb") else None
