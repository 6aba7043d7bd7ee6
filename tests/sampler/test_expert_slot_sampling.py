"""Sampling a ``MultiLoraTransformersModel`` whose adapter slots hold LoRA on a mixture-of-experts
model's fused experts (PEFT's ``ParamWrapper``, one adapter per forward).

A shared decoding batch (``twinkle.sampler.batch.DecodeBatch``) whose rows name different
adapters gives each row its own adapter's expert update (``slot_experts.rows_by_adapter``): its
greedy tokens are the ones ``TorchSampler`` samples for that row alone with its adapter, and its
log-probs agree within ``tolerances.chain_tolerances`` of the model's sums (the same products over
other rows, another summation order at most); so do rows that all share one adapter (the batch
activates it as a lone sample does). ``TorchSampler`` with one adapter for every row
samples what a plain ``TransformersModel`` carrying that adapter as PEFT's own samples. A mixed
``forward_only(adapter_names=[...])`` over expert slots gives each row its own adapter's
log-probabilities, within the same tolerances.

On a tiny random Qwen3-MoE (8 experts, top 2) whose matrices are scaled up, so that greedy
tokens win by clear margins. Three adapters reach the experts differently: ``a`` the attention's
``q_proj`` and both expert parameters, ``b`` only ``gate_up_proj``, ``c`` only ``down_proj``;
their LoRA B is not zero, so each moves the model's outputs."""

import json

import pytest
import torch
import transformers
from peft import LoraConfig
from tolerances import chain_tolerances, llama_sums

from twinkle.data_format import SamplingParams
from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.slot_experts import rows_by_adapter
from twinkle.sampler import TorchSampler
from twinkle.sampler.batch import DecodeBatch
from twinkle.sampler.row_adapters import SlotRowAdapters
from twinkle.utils.errors import UserError

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
    "b": dict(r=2, lora_alpha=2, target_modules=[], target_parameters=EXPERTS[:1]),
    "c": dict(r=8, lora_alpha=16, target_modules=[], target_parameters=EXPERTS[1:]),
}
HIDDEN, MOE, LAYERS, VOCAB, TOP_K = 32, 16, 2, 600, 2
P1, P2 = [5, 6, 7, 8, 9], [40, 41, 42]
MAX_TOKENS = 12
# (adapter, prompt, num_samples): a and b on one prompt, a twice, on rows that are not neighbours
REQUESTS = [("a", P1, 1), ("b", P1, 1), ("c", P2, 2), ("a", P2, 1), ("c", P1, 1)]


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
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8)  # sharp: clear greedy margins
    out = tmp_path_factory.mktemp("qwen3-moe-sharp")
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


@pytest.fixture(scope="module")
def multi(moe_dir):
    """The slots reach q_proj and both expert parameters; each adapter's weights random."""
    slots = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
    model = MultiLoraTransformersModel(str(moe_dir), max_loras=3, max_r=8, lora_config=slots)
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        model.add_adapter_to_model(name, LoraConfig(**spec))
        gen = torch.Generator().manual_seed(100 + i)
        shapes = model.slots.export_names(name)
        assert not model.slots.load(name, {k: torch.randn(s, generator=gen) * 0.2 for k, s in shapes})
    model._lazy_wrap_model()
    return model


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, num_samples=n, seed=0, logprobs=1)


def alone(
    sampler: TorchSampler, name: str, prompt: list[int], n: int
) -> list[tuple[list[int], torch.Tensor]]:
    """(tokens, their log-probs) of each sequence ``sampler`` samples for ``prompt`` alone."""
    (response,) = sampler.sample({"input_ids": prompt}, greedy(n), adapter_name=name)
    return [(list(s.tokens), torch.tensor([e[0][1] for e in s.logprobs])) for s in response.sequences]


def tolerances(reference: torch.Tensor) -> dict:
    """The model's chain of sums over the longest row, each layer's LoRA (rank 8) and routed
    experts (top 2) besides."""
    tokens = max(len(P1), len(P2)) + MAX_TOKENS
    return chain_tolerances(llama_sums(HIDDEN, MOE, LAYERS, tokens, VOCAB) + [8 + TOP_K] * LAYERS, reference)


def batched_against_alone(multi, requests) -> list[list]:
    """``requests`` sampled together in one ``DecodeBatch`` equal each sampled alone by
    ``TorchSampler``; the runs of each step that ran rows of several adapters (``adapters.rows``)."""
    solo = [alone(TorchSampler(multi), name, prompt, n) for name, prompt, n in requests]
    batch = DecodeBatch(causal_lm_of(multi.model), multi.tokenizer, SlotRowAdapters(multi))
    mixed_steps = []
    rows = batch.adapters.rows
    batch.adapters.rows = lambda runs: (mixed_steps.append(runs), rows(runs))[1]
    streams = [batch.add(name, prompt, greedy(n), 0) for name, prompt, n in requests]
    batch.run(None)
    assert all(s.done for s in streams) and batch.cache is None
    for stream, want in zip(streams, solo, strict=True):
        got = stream.result()
        assert len(got) == len(want)
        for row, (tokens, logps) in zip(got, want, strict=True):
            assert row.tokens == tokens, (stream.adapter, row.tokens, tokens)
            row_logps = torch.tensor([e[0][1] for e in row.logprobs])
            torch.testing.assert_close(row_logps, logps, **tolerances(logps))
    return mixed_steps


def test_rows_of_different_adapters_decode_as_each_row_alone(multi):
    # each adapter's expert update moves the outputs: a row run through another's would differ
    on_p1 = {name: alone(TorchSampler(multi), name, P1, 1)[0][0] for name in ADAPTERS}
    assert len({tuple(tokens) for tokens in on_p1.values()}) == len(ADAPTERS)
    mixed_steps = batched_against_alone(multi, REQUESTS)
    assert mixed_steps and len({n for _, _, n in mixed_steps[0]}) == 3  # one forward, every adapter


def test_rows_of_one_adapter_decode_as_each_row_alone(multi):
    assert not batched_against_alone(multi, [("b", P1, 1), ("b", P2, 2), ("b", P1, 1)])  # one(name)


def test_one_adapter_for_every_row_samples_what_a_plain_peft_model_samples(multi, moe_dir, tmp_path):
    shared = TorchSampler(multi)
    prompts = [{"input_ids": P1}, {"input_ids": P2}]
    for name, spec in ADAPTERS.items():
        folder = multi.save(f"{name}-saved", output_dir=str(tmp_path), adapter_name=name)
        plain = TransformersModel(model_id=str(moe_dir))
        plain.add_adapter_to_model("default", LoraConfig(**spec))
        plain.load(str(folder))
        want = TorchSampler(plain).sample(prompts, greedy(2))
        got = shared.sample(prompts, greedy(2), adapter_name=name)
        for g, w in zip(got, want, strict=True):
            for gs, ws in zip(g.sequences, w.sequences, strict=True):
                assert list(gs.tokens) == list(ws.tokens), name
                reference = torch.tensor([e[0][1] for e in ws.logprobs])
                got_logps = torch.tensor([e[0][1] for e in gs.logprobs])
                torch.testing.assert_close(got_logps, reference, **tolerances(reference))


def test_grouped_experts_equal_each_adapter_on_its_own_rows(multi):
    """``rows_by_adapter`` on one experts module: rows of a, of b, of none, of a again, each
    exactly (bitwise) what the module computes for those rows under the adapter alone."""
    table = multi.slots
    experts = causal_lm_of(multi.model).model.layers[0].mlp.experts  # the outermost wrapper
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, HIDDEN, generator=gen)
    index = torch.randint(0, 8, (7, TOP_K), generator=gen)
    weights = torch.rand(7, TOP_K, generator=gen)
    runs = [(0, 2, "a"), (2, 3, "b"), (4, 7, "a")]  # row 3 in no run
    slots = [(s, e, table.holder[n]) for s, e, n in runs]
    targets = {table.holder[n]: set(table.targets[n]) for n in ADAPTERS}
    with torch.no_grad():
        with rows_by_adapter(table.layers, slots, targets):
            got = experts(x, index, weights)
        want = torch.empty_like(got)
        for name, rows in (("a", [0, 1, 4, 5, 6]), ("b", [2]), (None, [3])):
            table.activate(name)
            want[rows] = experts(x[rows], index[rows], weights[rows])
        table.activate(None)
        multi.adapters.active = None
    assert torch.equal(got, want)
    assert not torch.allclose(
        want[[0, 1]], experts(x[[0, 1]], index[[0, 1]], weights[[0, 1]])
    )  # a moved them
    with torch.no_grad(), rows_by_adapter(table.layers, slots, targets), pytest.raises(UserError) as info:
        experts(x[:5], index[:5], weights[:5])  # 5 tokens for 7 rows
    assert "own call" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("names", [["a", "b"], ["b", "a"]])
def test_a_mixed_forward_only_of_two_adapters_over_expert_slots_gives_each_row_its_own(multi, names):
    rows = [{"input_ids": ids, "labels": ids} for ids in (P1 + [10, 11], P2 + [12])]
    mixed = multi.forward_only(inputs=rows, adapter_names=names)["logps"]
    for row, name in enumerate(names):
        want = multi.forward_only(inputs=rows, adapter_name=name)["logps"][row]
        other = multi.forward_only(inputs=rows, adapter_name=names[1 - row])["logps"][row]
        tol = tolerances(want)
        torch.testing.assert_close(mixed[row], want, **tol)
        assert (other - want).abs().max() > 10 * (tol["atol"] + tol["rtol"] * want.abs().max())


def test_mixed_rows_under_expert_parallelism_are_one_line(multi, monkeypatch):
    """Under expert parallelism a rank's experts run the other ranks' rows of every slot, which
    the decoding batch's calls do not make alike on every rank: one line, before any decoding."""
    from twinkle.sampler import row_adapters

    monkeypatch.setattr(row_adapters, "expert_parallel_of", lambda lm: object())
    with pytest.raises(UserError) as info, SlotRowAdapters(multi).rows([(0, 1, "a"), (1, 2, "b")]):
        pass
    text = str(info.value)
    assert "\n" not in text and "expert parallelism" in text and "own call" in text
