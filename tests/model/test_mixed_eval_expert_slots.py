"""A mixed evaluation batch (``forward_only(adapter_names=[...])``) on a model whose adapter slots
hold LoRA on a mixture-of-experts model's fused experts (PEFT's ``ParamWrapper``, which adds one
adapter's update for a whole forward).

Each row gets the log-probabilities of its own adapter's pass (``forward_only(adapter_name=...)``
over the same batch) and a row without adapter those of the base (``disable_lora=True``): the
experts run once per adapter on that adapter's rows (``slot_experts.rows_by_adapter``), the other
LoRA layers through PEFT's mixed batch. The mixed pass runs the rows padded and the lone ones may
pack them, so they agree up to the order of fp32 sums (``tolerances.chain_tolerances`` over the
model's chain of sums, each layer's LoRA of rank 8 and top-2 experts besides). The adapters' LoRA
B is not zero and each adapter's pass differs from the others' and the base's by far more than
that tolerance, so a row run through the wrong adapter fails.

Under expert parallelism the experts exchange tokens across ranks in each call, so every rank
runs them once for every slot and once without adapter (``rows_by_adapter(every_slot=True)``);
in one process that schedule gives bitwise the grouped output, with the same calls whichever
adapters the rows name, and on 2 gloo ranks (``-m cluster``; this file is the ranks' script)
whose rows name different adapters each row still gets its own adapter's pass.

On a tiny random Qwen3-MoE (8 experts, top 2): ``a`` reaches the attention's ``q_proj`` and both
expert parameters, ``b`` the experts' ``gate_up_proj`` only; the slots' default config
(``all-linear``: the experts and the router too) as well."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig
from ports import free_port
from tolerances import chain_tolerances, llama_sums

from twinkle.model import MultiLoraTransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.slot_experts import rows_by_adapter

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
    "b": dict(r=2, lora_alpha=2, target_modules=[], target_parameters=EXPERTS[:1]),
}
HIDDEN, MOE, LAYERS, VOCAB, TOP_K = 32, 16, 2, 600, 2
NAMES = ["a", "b", None, "a"]
ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle, a model."}]},
    {"messages": [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "France, my friend"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, how are you?"}]},
    {"messages": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    ids = {k: config.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}
    config = transformers.Qwen3MoeConfig(
        **ids, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE, intermediate_size=64,
        norm_topk_prob=True, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen3-moe")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


def with_random_adapters(model, specs: dict) -> MultiLoraTransformersModel:
    """``specs`` added to ``model``, each slot's weights random (B not zero: each adapter moves
    the outputs)."""
    for i, (name, spec) in enumerate(specs.items()):
        model.add_adapter_to_model(name, LoraConfig(**spec))
        gen = torch.Generator().manual_seed(100 + i)
        shapes = model.slots.export_names(name)
        assert not model.slots.load(name, {k: torch.randn(s, generator=gen) * 0.2 for k, s in shapes})
    return model


def tolerances(reference: torch.Tensor, tokens: int) -> dict:
    """The model's chain of sums over a row, each layer's LoRA (rank 8) and routed experts besides."""
    return chain_tolerances(llama_sums(HIDDEN, MOE, LAYERS, tokens, VOCAB) + [8 + TOP_K] * LAYERS, reference)


def passes(model, rows, names) -> tuple[torch.Tensor, dict]:
    """The mixed pass's log-probabilities, and each adapter's own pass (None: the base's)."""
    mixed = model.forward_only(inputs=rows, adapter_names=names)["logps"]
    alone = {n: model.forward_only(inputs=rows, adapter_name=n)["logps"] for n in ADAPTERS}
    alone[None] = model.forward_only(inputs=rows, adapter_name="a", disable_lora=True)["logps"]
    return mixed, alone


def each_row_as_its_own(mixed: torch.Tensor, alone: dict, names) -> None:
    assert mixed.shape == alone[None].shape and mixed.shape[0] == len(names)
    tol = tolerances(alone[None], mixed.shape[1])
    for row, name in enumerate(names):
        scored = alone[name][row] != 0
        assert scored.sum() > 3, row  # the row has labels to compare
        torch.testing.assert_close(mixed[row], alone[name][row], **tol, msg=f"row {row} ({name})")
        for other in alone.keys() - {name}:  # another adapter's pass (or the base) is far off
            gap = (alone[other][row] - alone[name][row]).abs().max()
            assert gap > 10 * (tol["atol"] + tol["rtol"] * alone[name][row].abs().max()), (row, name, other)


def each_row_as_its_own_pass(model, names) -> None:
    each_row_as_its_own(*passes(model, ROWS, names), names)


def no_row_state_left(model) -> None:
    """The pass took back what it put on the slots' layers: instance forwards, hooks."""
    for layer in model.slots.layers.values():
        assert "forward" not in layer.__dict__ and not layer._forward_pre_hooks


@pytest.fixture(scope="module")
def multi(moe_dir):
    """Slots on q_proj and both expert parameters (one slot left free), ``ADAPTERS`` in two."""
    slots = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
    model = MultiLoraTransformersModel(str(moe_dir), max_loras=3, max_r=8, lora_config=slots)
    return with_random_adapters(model, ADAPTERS)


def test_rows_of_two_adapters_and_the_base_get_their_own_passes(multi):
    each_row_as_its_own_pass(multi, NAMES)
    no_row_state_left(multi)
    each_row_as_its_own_pass(multi, ["b", "b", "a", None])  # runs of equal adapters, the base last


@pytest.mark.parametrize("runs", [[(0, 2, "a"), (2, 3, None)], [(0, 3, "b")], [(0, 1, None), (1, 3, "a")]])
def test_every_slot_makes_the_same_calls_whatever_the_rows(multi, runs):
    """``every_slot`` (expert parallelism: each call of the experts exchanges tokens with the
    other ranks) runs an experts module once for every slot and once without adapter, on no
    tokens where the rows have none, whichever adapters the rows name; its output is bitwise the
    grouped one's."""
    table = multi.slots
    top = causal_lm_of(multi.model).model.layers[0].mlp.experts  # the outermost wrapper
    inner = top
    while hasattr(inner, "base_layer"):
        inner = inner.base_layer
    calls = []
    handle = inner.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    gen = torch.Generator().manual_seed(1)
    x, index = torch.randn(9, HIDDEN, generator=gen), torch.randint(0, 8, (9, TOP_K), generator=gen)
    weights = torch.rand(9, TOP_K, generator=gen)
    slots = [(s, e, None if n is None else table.holder[n]) for s, e, n in runs]
    targets = {table.holder[n]: set(table.targets[n]) for n in ADAPTERS}
    try:
        with torch.no_grad():
            with rows_by_adapter(table.layers, slots, targets):
                grouped = top(x, index, weights)
            assert len(calls) == len({n for _, _, n in runs})
            calls.clear()
            with rows_by_adapter(table.layers, slots, targets, every_slot=True):
                every = top(x, index, weights)
    finally:
        handle.remove()
    assert len(calls) == len(table.names) + 1 and sum(calls) == x.shape[0], calls
    assert torch.equal(every, grouped)


def test_the_default_slots_reach_the_router_too(moe_dir):
    model = MultiLoraTransformersModel(str(moe_dir), max_loras=2, max_r=8)  # all-linear
    assert any(k.endswith(".mlp.gate") or ".mlp.gate." in k for k in model.slots.layers)
    specs = {"a": dict(r=4, lora_alpha=8, target_modules="all-linear"), "b": ADAPTERS["b"]}
    with_random_adapters(model, specs)
    each_row_as_its_own_pass(model, NAMES)
    no_row_state_left(model)


# ---------------------------------------------------------------- under expert parallelism
EP_NAMES = {0: ["a", "b"], 1: [None, "a"]}  # per rank: the ranks' calls of the experts differ


@pytest.mark.slow
@pytest.mark.cluster
def test_under_expert_parallelism_each_row_gets_its_own_adapter(moe_dir, tmp_path):
    """2 gloo ranks, each holding 4 of the 8 experts and 2 of the rows, whose rows name different
    adapters: a rank's experts run the other rank's tokens of each adapter with that adapter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
    assets = str(Path(__file__).parents[1] / "assets")
    env.update(OMP_NUM_THREADS="1", TWINKLE_CACHE=str(tmp_path / "cache"), PYTHONPATH=assets)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), __file__, str(moe_dir), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for rank, names in EP_NAMES.items():
        each_row_as_its_own(*torch.load(tmp_path / f"rank{rank}.pt"), names)


def ep_worker(model_dir: str, out: str) -> None:
    """One rank of the run above: its share of ``ROWS`` and its names, both passes saved."""
    import twinkle
    from twinkle import DeviceMesh

    runtime = twinkle.initialize(
        mode="local", global_device_mesh=DeviceMesh.from_sizes(ep_size=2), timeout_s=60
    )
    slots = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
    model = MultiLoraTransformersModel(
        model_dir, max_loras=3, max_r=8, lora_config=slots, fsdp_config={"expert_parallel": {"enabled": True}}
    )
    with_random_adapters(model, ADAPTERS)
    model._lazy_wrap_model()  # the experts split, the slots in
    rank = runtime.rank
    torch.save(passes(model, ROWS[2 * rank : 2 * rank + 2], EP_NAMES[rank]), Path(out, f"rank{rank}.pt"))
    twinkle.runtime.shutdown()


if __name__ == "__main__":
    ep_worker(*sys.argv[1:3])
