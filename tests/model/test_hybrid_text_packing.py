"""Text rows on the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: linear-attention layers
among full-attention ones) train packed: the loss, the labels' log-probabilities and every LoRA
gradient equal the padded batch's, with one prefix shared by every row, a prefix per pair of rows
and none. The step ran packed (each linear-attention layer saw one row per sample); run across
the samples, the linear-attention layers give other gradients, far outside the tolerance.
Teacher scoring packs too; rows of several adapters run padded, each through its adapter."""

import pytest
import torch
import transformers
from tiny import build_tokenizer
from tolerances import chain_tolerances, llama_sums

import twinkle.model.packing as packing
from twinkle.model.linear_attention_packing import LINEAR_ATTENTION_CLASSES

IGNORE = -100
HIDDEN, INTERMEDIATE, HEAD, CONV, CHUNK = 64, 128, 16, 4, 64  # CHUNK: transformers' scan chunk
SHAPE = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=HEAD,
    linear_value_head_dim=HEAD,
    linear_conv_kernel_dim=CONV,
    max_position_embeddings=512,
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, {}),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, MOE),
    "qwen3_next": (transformers.Qwen3NextConfig, MOE),
}
VOCAB = 600  # the tests' tokenizer (tiny.build_tokenizer)
# own lengths: one row within a chunk of the scan, two across chunk boundaries
LENGTHS = (9, 70, 4, 130)
PROMPT = {"one": 8, "pairs": 12, "none": 3}  # each layout's prompt length


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny random checkpoint per family, with the tests' byte-level tokenizer."""
    out = {}
    for name, (config_cls, extra) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        tok = build_tokenizer(folder)
        config = config_cls(**SHAPE, **extra, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert model.config.model_type == name
        model.save_pretrained(folder)
        out[name] = folder
    return out


def _batch(layout: str) -> dict[str, torch.Tensor]:
    """Right-padded rows of unequal lengths: after one 8-token prompt every row starts with
    (``one``), after a 12-token prompt per pair of rows (``pairs``) or with nothing in common
    (``none``); the labels start after the prompt."""
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=g).tolist()

    common = tokens(8)
    pair = [tokens(12), tokens(12)]
    rows, prompt = [], PROMPT[layout]
    for i, n in enumerate(LENGTHS):
        head = {"one": common, "pairs": pair[i // 2], "none": tokens(3)}[layout]
        rows.append(head + tokens(n))
    width = max(map(len, rows))
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    batch["labels"] = torch.full((len(rows), width), IGNORE)
    batch["position_ids"] = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        batch["input_ids"][i, :n] = torch.tensor(row)
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
        batch["labels"][i, prompt:n] = torch.tensor(row[prompt:])
    return batch


def _model(folder, padding_free: bool):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(str(folder), padding_free=padding_free)
    torch.manual_seed(0)
    # init_lora_weights=False: B is random too, so every LoRA gradient is non-zero
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", lora)
    return model


def _linear_attention_calls(model) -> list[tuple[int, int]]:
    """The (rows, tokens) each linear-attention layer computes in one call, recorded at its output
    projection (the layer's own forward runs inside the per-sample split)."""
    calls = []
    for module in model.model.modules():
        if type(module).__name__ in LINEAR_ATTENTION_CLASSES:
            module.out_proj.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape[:2])))
    return calls


def _run(folder, batch, padding_free: bool):
    """The step's loss and LoRA gradients, the labels' log-probabilities, and the shapes the
    linear-attention layers saw."""
    model = _model(folder, padding_free)
    calls = _linear_attention_calls(model)
    loss = float(model.forward_backward(inputs=batch))
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    logps = model.forward_only(inputs=batch)["logps"]
    return loss, grads, logps, calls


def _sums(batch, vocab: int) -> list[int]:
    """The sums along the forward and backward (``tolerances.py``): the two full-attention layers
    as a Llama's; each linear-attention layer's projections (hidden), convolution (its kernel),
    key and query norms and products (head dim), the scan's triangular solve within a chunk (up
    to CHUNK - 1 earlier rows, each a sum of up to CHUNK - 1 terms: CHUNK^2 to first order), its
    decay cumsum and products over a chunk (CHUNK each), the state read (head dim) and carried
    over every earlier token (tokens), the gated norm (head dim), the output projection (value
    width) and the MLP, each twice (forward, backward); a weight's gradient summed over every
    row's tokens."""
    rows, tokens = batch["input_ids"].shape
    value = 4 * HEAD
    steps = [HIDDEN, CONV, 5 * HEAD, CHUNK * CHUNK, 3 * CHUNK, tokens, HEAD, value, 3 * HIDDEN, INTERMEDIATE]
    linear = 2 * sum(steps)
    return llama_sums(HIDDEN, INTERMEDIATE, 2, tokens, vocab) + [linear, linear, (rows - 1) * tokens]


@pytest.mark.parametrize("layout", ["one", "pairs", "none"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_step_equals_padded(folders, family, layout):
    batch = _batch(layout)
    segments = packing.pack(batch)["twinkle_segments"]
    # the prompt but its last token, whose target is the first label
    if layout == "one":
        assert segments.prefix == 7 and not segments.blocks
    elif layout == "pairs":
        assert [n for _, n, _ in segments.blocks] == [11, 11]
    else:
        assert segments.prefix == 0 and not segments.blocks
    loss_a, grads_a, logps_a, calls_a = _run(folders[family], batch, padding_free=False)
    loss_b, grads_b, logps_b, calls_b = _run(folders[family], batch, padding_free=True)
    # padded: each layer saw the whole batch; packed: one row per sample, its prefix in front, up
    # to its last token but one (the last has no target); two layers, forward_backward then
    # forward_only
    rows, width = batch["input_ids"].shape
    assert set(calls_a) == {(rows, width)}
    own = [(1, PROMPT[layout] + n - 1) for n in LENGTHS]
    assert calls_b == own * 4
    sums = _sums(batch, vocab=VOCAB)
    loss_a, loss_b = torch.tensor(loss_a), torch.tensor(loss_b)
    torch.testing.assert_close(loss_b, loss_a, **chain_tolerances(sums, loss_a))
    torch.testing.assert_close(logps_b, logps_a, **chain_tolerances(sums, logps_a))
    assert grads_a.keys() == grads_b.keys() and any("linear_attn" in n for n in grads_a)
    assert all("lora_" in n for n in grads_a)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, **chain_tolerances(sums, grad), msg=name)


def _excess(actual: torch.Tensor, expected: torch.Tensor, sums: list[int]) -> float:
    """How many times over ``assert_close``'s allowance with ``chain_tolerances`` ``actual`` is
    (above 1: the check fails)."""
    tol = chain_tolerances(sums, expected)
    return float(((actual - expected).abs() / (tol["atol"] + tol["rtol"] * expected.abs())).max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_without_the_per_sample_split_the_packed_step_is_off(folders, family, monkeypatch):
    """Run across the packed row's samples, the linear-attention layers carry one sample's state
    into the next: the gradients move far outside the check's tolerance, so the check above sees
    the samples' boundaries. (At random initialisation the linear-attention layers move the loss
    itself less than the gradients of their own adapters.)"""
    batch = _batch("none")
    loss_a, grads_a, _, _ = _run(folders[family], batch, padding_free=False)
    monkeypatch.setattr(packing, "run_per_sample", lambda lm: None)
    model = _model(folders[family], True)
    calls = _linear_attention_calls(model)
    loss_b = float(model.forward_backward(inputs=batch))
    assert calls == [(1, sum(PROMPT["none"] + n - 1 for n in LENGTHS))] * 2  # packed, one call per layer
    grads_b = {n: p.grad for n, p in model.model.named_parameters() if p.grad is not None}
    sums = _sums(batch, vocab=VOCAB)
    assert loss_b != loss_a
    assert max(_excess(grads_b[n], grads_a[n], sums) for n in grads_a) > 100


def test_rows_of_several_adapters_run_padded(folders):
    """A key per row (the adapter each row runs through) packs on the other families; here the
    batch runs padded, as a linear-attention layer's LoRA layers see one sample's span at a time
    and the adapters' places are the whole row's (``packing.can_pack``)."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3_5_text"])
    assert not packing.can_pack(lm, ["a", "a", "b", "b"])
    assert packing.can_pack(lm, True) and packing.can_pack(lm, False)


def test_teacher_scores_of_packed_rows_equal_the_padded_batchs(folders, monkeypatch):
    """Scoring (``scoring_topk.topk_at_targets``: a teacher's top-k, the sampler's prompt
    scores) packs the rows too, the shared prefix held once: the scores equal the padded
    batch's."""
    from twinkle.model import scoring_topk

    lm = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3_next"]).eval()
    batch = {k: v for k, v in _batch("one").items() if k != "position_ids"}
    calls = []
    for module in lm.modules():
        if type(module).__name__ in LINEAR_ATTENTION_CLASSES:
            module.out_proj.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape[:2])))
    packed = scoring_topk.topk_at_targets(lm, batch, 4)
    assert calls == [(1, PROMPT["one"] + n - 1) for n in LENGTHS] * 2  # per sample, the prefix in front
    monkeypatch.setattr(scoring_topk, "can_pack", lambda lm: False)
    calls.clear()
    padded = scoring_topk.topk_at_targets(lm, batch, 4)
    assert set(calls) == {tuple(batch["input_ids"].shape)}
    assert packed.chosen.shape == (sum(LENGTHS),)  # every label, in the padded batch's order
    sums = _sums(batch, vocab=VOCAB)
    torch.testing.assert_close(packed.chosen, padded.chosen, **chain_tolerances(sums, padded.chosen))
    torch.testing.assert_close(packed.values, padded.values, **chain_tolerances(sums, padded.values))


def _mixed_logps(folder, names: list[str | None]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward_only(adapter_names=names)``'s log-probs, and each adapter's own pass over the
    whole batch."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(str(folder))
    torch.manual_seed(0)
    for name in ("a", "b"):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model.add_adapter_to_model(name, lora)
    batch = _batch("none")
    alone = {name: model.forward_only(batch, adapter_name=name)["logps"] for name in set(names) - {None}}
    model.forward_only(batch, adapter_names=names)
    return model.last_outputs["logps"], alone


def test_a_mixed_adapter_batch_runs_row_by_row(folders, monkeypatch):
    """Rows of several adapters run padded here, each LoRA layer through each row's adapter
    (PEFT's mixed batch): each row's log-probs equal its adapter's own pass. Placed as in a packed
    row while the forward runs padded, the adapters would land on other rows' tokens."""
    from twinkle.model import metrics_api

    names = ["b", None, "b", "b"]
    mixed, alone = _mixed_logps(folders["qwen3_5_text"], names)
    batch = _batch("none")
    sums = _sums(batch, vocab=VOCAB)
    for row in (0, 2, 3):
        torch.testing.assert_close(mixed[row], alone["b"][row], **chain_tolerances(sums, alone["b"][row]))
    monkeypatch.setattr(metrics_api, "can_pack", lambda lm, names: True)  # runs as if packed
    mixed, alone = _mixed_logps(folders["qwen3_5_text"], names)
    assert max(_excess(mixed[row], alone["b"][row], sums) for row in (0, 2, 3)) > 10
