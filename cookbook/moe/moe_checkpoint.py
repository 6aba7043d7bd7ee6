"""A mixture-of-experts checkpoint made on this machine from the bundled SmolLM2-135M-Instruct,
for ``ep_lora.py`` to train in minutes on a CPU: a Qwen2-MoE with SmolLM2's 30 layers, every
``SPARSE_STEP``-th of them a mixture of ``EXPERTS`` experts (top-2, renormalised), each expert a
copy of that layer's SmolLM2 MLP; every other weight is SmolLM2's.

Why copies: with every expert equal and the two chosen weights summing to one, each MoE layer
computes exactly SmolLM2's MLP whatever the (random) router chooses, so the model starts as
SmolLM2 does, with a loss a LoRA run visibly lowers; training LoRA on the experts makes them
differ. (A random model instead starts at the uniform loss, ln of the vocabulary, and a LoRA run
hardly moves it: its random embeddings, which LoRA does not train, decide the output; SmolLM2's
first layers alone, without the rest, start far above it.) Qwen2-MoE's attention is Llama's
once its q, k, v biases are off (``qkv_bias=False``); its shared expert, which the family has, is
kept with its output projection at zero, so it adds nothing.

``moe_checkpoint()`` builds it once into the Twinkle cache (``$TWINKLE_CACHE`` or
``~/.cache/twinkle``) and returns the folder."""

import shutil
from pathlib import Path

import torch

EXPERTS = 8
SPARSE_STEP = 7  # every 7th of SmolLM2's 30 layers is a mixture of experts: layers 6, 13, 20 and 27
NAME = f"smollm2-135m-{EXPERTS}e-every-{SPARSE_STEP}-qwen2-moe-v1"  # a new name whenever what is built here changes


def moe_checkpoint(seed: int = 0) -> str:
    from twinkle.hub.cache import ensure_converted
    from twinkle.utils.cache import cache_root

    return str(ensure_converted(cache_root() / "cookbook" / NAME, lambda folder: build(folder, seed)))


def build(out: Path, seed: int = 0) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from twinkle.hub import resolve_model

    smol_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))
    smol = LlamaForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    text = smol.config
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        moe_intermediate_size=text.intermediate_size,
        shared_expert_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=text.num_hidden_layers,
        decoder_sparse_step=SPARSE_STEP,
        mlp_only_layers=[],
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        qkv_bias=False,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config)  # the routers and the shared experts stay as made here
    source = smol.state_dict()
    weights = {name: source[name] for name in ("model.embed_tokens.weight", "model.norm.weight")}
    for layer in range(text.num_hidden_layers):
        head = f"model.layers.{layer}"
        if (layer + 1) % SPARSE_STEP:  # a dense layer: SmolLM2's own
            weights.update({n: t for n, t in source.items() if n.startswith(head + ".")})
            continue
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{head}.{name}.weight"] = source[f"{head}.{name}.weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"{head}.self_attn.{name}.weight"] = source[f"{head}.self_attn.{name}.weight"]
        gate_up = torch.cat([source[f"{head}.mlp.gate_proj.weight"], source[f"{head}.mlp.up_proj.weight"]])
        weights[f"{head}.mlp.experts.gate_up_proj"] = gate_up.expand(EXPERTS, -1, -1).clone()
        weights[f"{head}.mlp.experts.down_proj"] = (
            source[f"{head}.mlp.down_proj.weight"].expand(EXPERTS, -1, -1).clone()
        )
        shared = model.model.layers[layer].mlp.shared_expert.down_proj.weight
        weights[f"{head}.mlp.shared_expert.down_proj.weight"] = torch.zeros_like(shared)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all(".mlp.gate." in n or ".mlp.shared_expert" in n or n == "lm_head.weight" for n in missing), (
        missing
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for extra in smol_dir.glob("generation_config.json"):
        shutil.copy(extra, out / extra.name)
