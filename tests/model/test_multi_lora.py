"""``MultiLoraTransformersModel``: several adapters on one base model, each trained as if alone.

Adapters ``a`` (r 8, all linear layers, AdamW with a schedule, accumulation window of 2) and
``b`` (r 4, three modules, Muon at another learning rate, no accumulation), both with dropout so
that their RNG streams matter, on the tiny Llama in fp32 (``max_r`` 8)."""

import json

import pytest
import torch
from batches import padded_batches
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from tolerances import probable_gamma, tiny_batch_sums
from transformers import AutoModelForCausalLM

from twinkle.loss.cross_entropy import target_logps
from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.lora_modes import BASE_ROW, token_runs
from twinkle.model.packing import pack, shifted_targets
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

STEPS = 10
SPECS = {
    "a": dict(
        config=dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear"),
        gas=2,
        optimizer=("AdamW", 1e-2, {}),
        schedule=True,
    ),
    "b": dict(
        config=dict(r=4, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]),
        gas=1,
        optimizer=("Muon", 2e-2, {"adjust_lr_fn": "match_rms_adamw"}),
        schedule=False,
    ),
}


def add(model, name: str, spec_of: str | None = None) -> None:
    spec = SPECS[spec_of or name]
    model.add_adapter_to_model(name, LoraConfig(**spec["config"]), gradient_accumulation_steps=spec["gas"])
    cls, lr, kwargs = spec["optimizer"]
    model.set_optimizer(cls, lr=lr, adapter_name=name, **kwargs)
    if spec["schedule"]:
        model.set_lr_scheduler(
            "CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=STEPS, adapter_name=name
        )


def make(tiny_model_dir, *names: str, max_loras: int = 3, max_r: int = 8) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=max_loras, max_r=max_r)
    for name in names:
        add(model, name)
    return model


def step(model, name: str, batch) -> None:
    model.forward_backward(inputs=batch, adapter_name=name)
    model.clip_grad_and_step(adapter_name=name)


def flat(state, prefix: str = "") -> dict:
    """A (nested) state dict as {path: value}, tensors cloned."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}/{i}").items()}
    return {prefix: state.clone() if torch.is_tensor(state) else state}


def assert_states_close(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(
                actual[key], value, atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}"
            )
        else:
            assert actual[key] == value, key


def snapshot(model, name: str) -> tuple[dict, dict]:
    return flat(model.get_state_dict(adapter_name=name)), flat(
        model.optimizer_group[name].optimizer.state_dict()
    )


def label_logps(logits: torch.Tensor, batch) -> torch.Tensor:
    """Each label's log-probability, aligned with the labels (0 where none), as forward_only gives."""
    targets = shifted_targets(batch["labels"], batch["attention_mask"])
    logps = target_logps(logits.float(), targets).masked_fill(targets == IGNORE_INDEX, 0.0)
    return torch.cat([torch.zeros_like(logps[:, :1]), logps[:, :-1]], dim=1)


@pytest.fixture(scope="module")
def batches(dataset):
    return list(padded_batches(dataset, batch_size=2))[:STEPS]


@pytest.fixture(scope="module")
def interleaved(tiny_model_dir, batches):
    """a, b, a, b, ... for STEPS micro-batches each; b's probe logps before and after a step of a."""
    model = make(tiny_model_dir, "a", "b")
    probe = batches[0]
    probes = []
    for i, batch in enumerate(batches):
        step(model, "a", batch)
        model.forward_only(probe, adapter_names=["b", "b"])
        probes.append(model.last_outputs["logps"].clone())
        step(model, "b", batches[-1 - i])
        model.forward_only(probe, adapter_names=["b", "b"])
        probes.append(model.last_outputs["logps"].clone())
    return model, probes


def test_interleaved_adapters_end_like_solo_runs(tiny_model_dir, batches, interleaved):
    """Each adapter's weights and optimizer state after the interleaved run equal those of a run
    of it alone in its own model (same data, same seed), and b's outputs do not move while a
    trains. The two runs compute the same operations on the same values; 1e-6 is the issue's bar."""
    model, probes = interleaved
    solo_a = make(tiny_model_dir, "a")  # one model after the other: they share the global RNG
    for batch in batches:
        step(solo_a, "a", batch)
    solo_b = make(tiny_model_dir, "b")
    for i in range(STEPS):
        step(solo_b, "b", batches[-1 - i])
    for name, solo in (("a", solo_a), ("b", solo_b)):
        weights, optim = snapshot(model, name)
        solo_weights, solo_optim = snapshot(solo, name)
        assert any(v.abs().max() > 1e-3 for k, v in weights.items() if "lora_B" in k)  # it trained
        assert_states_close(weights, solo_weights)
        assert_states_close(optim, solo_optim)
    assert model.optimizer_group["a"].optimizer_steps == STEPS // 2
    assert model.optimizer_group["b"].optimizer_steps == STEPS
    # probes[2i] follows a's step i, probes[2i+1] b's: b's outputs change only with b's own steps
    for i in range(1, STEPS):
        assert torch.equal(probes[2 * i], probes[2 * i - 1])
        assert not torch.equal(probes[2 * i + 1], probes[2 * i])


@pytest.mark.parametrize("optimizer, steps", [("Muon", 1), ("AdamW", 3)])
def test_slot_optimizer_updates_like_a_plain_rank_r_adapter(tiny_model_dir, batches, optimizer, steps):
    """A rank-4 adapter in a slot of max_r 48 (wider than the hidden size 32, so a padded A would
    change Muon's shape-dependent learning rate and orthogonalisation) moves like a plain rank-4
    PEFT adapter that starts from the same weights: the optimizer sees the rank-4 parts only.

    The first step's gradients are bit-identical (B is zero, the padded rows add exact zeros).
    Later ones differ by a few ulps, as the padded products block their sums differently, and
    Muon's bf16 Newton-Schulz would amplify those, so Muon is compared on one step and AdamW
    (which moves a weight by about lr whatever the gradient's ulps) on three."""
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    multi = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=48)
    multi.add_adapter_to_model("x", LoraConfig(**config))
    plain = TransformersModel(str(tiny_model_dir))
    plain.add_adapter_to_model("x", LoraConfig(**config))
    set_peft_model_state_dict(plain.model, multi.get_state_dict(adapter_name="x"), adapter_name="x")
    kwargs = {"adjust_lr_fn": "match_rms_adamw"} if optimizer == "Muon" else {}
    for model in (multi, plain):
        model.set_optimizer(optimizer, lr=2e-2, adapter_name="x", **kwargs)
        for batch in batches[:steps]:
            step(model, "x", batch)
    ours, theirs = multi.get_state_dict(adapter_name="x"), plain.get_state_dict(adapter_name="x")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-6, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert_states_close(
        flat(multi.optimizer_group["x"].optimizer.state_dict()),
        flat(plain.optimizer_group["x"].optimizer.state_dict()),
    )


def test_disable_lora_gives_the_base_model(tiny_model_dir, batches, interleaved):
    """``forward_only(disable_lora=True)`` on trained adapters gives the base model's log-probs
    (the adapters' terms are not added), on both classes alike, bit for bit. Against Hugging Face's
    own padded forward of the base model it runs packed through other kernels, so each log-prob
    agrees within twice the probabilistic rounding bound of the tiny model's chain times its
    magnitude (``tolerances.probable_gamma``); the adapters move them by far more."""
    model, _ = interleaved
    batch = batches[1]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        expected = label_logps(base(**inputs).logits, batch)
    bound = 2 * probable_gamma(sum(tiny_batch_sums(batch["input_ids"]))) * expected.abs()
    loss = model.forward_only(batch, adapter_name="a", disable_lora=True)["loss"]
    off = model.last_outputs["logps"]
    assert bool(((off - expected).abs() <= bound).all()), float((off - expected).abs().max())
    assert loss == pytest.approx(model.last_outputs["loss"])
    assert off.shape == batch["labels"].shape
    assert torch.all(off[batch["labels"] == IGNORE_INDEX] == 0)
    single = TransformersModel(str(tiny_model_dir))
    single.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
    single.forward_only(batch, disable_lora=True)
    assert torch.equal(single.last_outputs["logps"], off)
    single.forward_only(batch, adapter_names=["default", "default"])
    assert float((single.last_outputs["logps"] - expected).abs().max()) > 100 * float(bound.max())


def _assert_each_row_alone(model, batch, names) -> torch.Tensor:
    """The mixed pass's log-probs of each row equal the row's own pass through its adapter (1e-6:
    see the test below); returns the mixed log-probs."""
    model.forward_only(batch, adapter_names=names)
    mixed = model.last_outputs["logps"]
    lm = causal_lm_of(model.model)
    for row, name in enumerate(names):
        one = {k: v[row : row + 1] for k, v in batch.items()}
        if name is None:
            model.forward_only(one, adapter_name="a", disable_lora=True)
            alone = model.last_outputs["logps"]
        else:
            model.adapters.activate(name)
            with torch.no_grad():
                inputs = {k: one[k] for k in ("input_ids", "attention_mask", "position_ids") if k in one}
                alone = label_logps(lm(**inputs).logits, one)
        torch.testing.assert_close(mixed[row : row + 1], alone, atol=1e-6, rtol=0)
    return mixed


@pytest.mark.parametrize("native", ["on", "off"])
def test_mixed_adapter_batch_equals_each_row_alone(dataset, interleaved, native, monkeypatch):
    """Rows of a, b and the base model in one pass give each row's log-probs as computed alone
    through its adapter. A row alone runs the same operations on the same values; only the batched
    products may block their sums differently, a few fp32 roundings of values below 10, hence 1e-6.
    So with the adapters' products in one C call per layer (``lora_segments``) and without."""
    from twinkle.kernel import switched
    from twinkle.kernel.lora import segments
    from twinkle.model import lora_modes

    taken = []
    real = lora_modes.add_segments
    monkeypatch.setattr(lora_modes, "add_segments", lambda *args: taken.append(real(*args)) or taken[-1])
    model, _ = interleaved
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    with switched({"TWINKLE_NATIVE_LORA_SEGMENTS": native}):
        mixed = _assert_each_row_alone(model, batch, ["a", "b", None, "a"])
    assert not torch.equal(mixed[0], mixed[2])  # the adapters change the rows they run on
    assert taken and all(taken) == (native == "on" and segments.library() is not None)


def test_consecutive_rows_of_one_adapter_hold_their_prefix_once(dataset, interleaved):
    """Rows of one adapter next to each other share their prefix (the chat markup every row starts
    with), held once per adapter: fewer tokens in the row, each row's log-probs as alone."""
    model, _ = interleaved
    batch = next(iter(padded_batches(dataset, batch_size=6)))
    names = ["a", "a", "b", "b", None, None]
    segments = pack(batch, share_prefix=names)["twinkle_segments"]
    assert len(segments.blocks) == 3 and all(n > 0 for _, n, _ in segments.blocks)
    assert segments.length < pack(batch, share_prefix=False)["twinkle_segments"].length
    runs = token_runs(batch, ["a", "a", "b", "b", BASE_ROW, BASE_ROW])
    assert [(start, name) for start, _, name in runs] == [(0, "a"), (segments.blocks[1][0], "b")]
    _assert_each_row_alone(model, batch, names)


def test_mixed_adapter_batch_runs_packed(dataset, interleaved):
    """A mixed batch whose loss needs no per-token inputs runs as one packed row: every LoRA
    layer sees a single row holding the batch's samples end to end (no pads), and ``a``'s samples
    at either end of the row form two runs of ``a``'s product."""
    from peft.tuners.lora import LoraLayer

    model, _ = interleaved
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    layer = next(m for m in model.model.modules() if isinstance(m, LoraLayer))
    seen = []
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape[:-1])))
    try:
        model.forward_only(batch, adapter_names=["a", "b", None, "a"])
    finally:
        hook.remove()
    assert len(seen) == 1 and seen[0][0] == 1
    assert seen[0][1] <= int(batch["attention_mask"].sum())  # no pad in the row
    runs = token_runs(batch, ["a", "b", BASE_ROW, "a"])
    assert [name for _, _, name in runs] == ["a", "b", "a"]
    assert all(start < end for start, end, _ in runs)
    assert "forward" not in layer.__dict__  # the layer's own forward is back


def test_saved_adapters_load_in_peft(tiny_model_dir, batches, interleaved, tmp_path):
    """Each adapter saved alone is a PEFT folder of its own rank and modules; PEFT loads it on the
    base model and gives the in-process logits (1e-5: PEFT's unfused layers sum the same terms
    in another order)."""
    model, _ = interleaved
    batch = batches[4]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    lm = causal_lm_of(model.model)
    lm.eval()
    for name in ("a", "b"):
        folder = model.save(f"{name}-final", output_dir=str(tmp_path), adapter_name=name)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == SPECS[name]["config"]["r"]
        model.adapters.activate(name)
        with torch.no_grad():
            ours = lm(**inputs).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
        lora_a = [p for n, p in peft_model.named_parameters() if "lora_A" in n]
        assert {p.shape[0] for p in lora_a} == {SPECS[name]["config"]["r"]}
        expected = 14 if name == "a" else 6  # 7 linear layers x 2 decoder layers; 3 x 2
        assert len(lora_a) == expected
        with torch.no_grad():
            theirs = peft_model(**inputs).logits
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    fresh = make(tiny_model_dir, "b", "a")  # other slots: load() places each adapter in its own
    for name in ("a", "b"):
        fresh.load(str(tmp_path / f"{name}-final"), adapter_name=name)
        assert_states_close(
            flat(fresh.get_state_dict(adapter_name=name)),
            flat(model.get_state_dict(adapter_name=name)),
            atol=0,
        )


def test_release_then_acquire_gives_the_initial_state(tiny_model_dir, batches):
    model = make(tiny_model_dir, "a", "b")
    initial = flat(model.get_state_dict(adapter_name="a"))
    slot = model.slots.holder["a"]
    step(model, "a", batches[0])
    step(model, "a", batches[1])
    assert not all(
        torch.equal(v, initial[k]) for k, v in flat(model.get_state_dict(adapter_name="a")).items()
    )
    model.remove_adapter("a")
    for layer in model.slots.layers.values():
        assert not layer.lora_A[slot].weight.any() and not layer.lora_B[slot].weight.any()
        assert layer.lora_A[slot].weight.grad is None
    add(model, "a")
    assert model.slots.holder["a"] == slot
    assert_states_close(flat(model.get_state_dict(adapter_name="a")), initial, atol=0)
    other = make(tiny_model_dir, "b", "a")  # another slot, another history: the same start
    assert other.slots.holder["a"] != slot
    assert_states_close(flat(other.get_state_dict(adapter_name="a")), initial, atol=0)


@pytest.mark.parametrize(
    "case, message",
    [
        ("full", "all 2 slots are taken (a, b); remove_adapter(...) one or raise max_loras="),
        ("rank", "has r=16, more than the slots' max_r=8; raise max_r="),
        ("unknown", "unknown adapter 'c'; adapters: a, b"),
        ("outside", "targets 'lm_head', which is outside the slots' modules ("),
        ("duplicate", "adapter 'a' already exists; remove_adapter('a') first"),
    ],
)
def test_limit_errors_are_one_line(tiny_model_dir, case, message):
    model = make(tiny_model_dir, "a", "b", max_loras=2)
    calls = {
        "full": lambda: model.add_adapter_to_model("c", LoraConfig(r=4)),
        "rank": lambda: model.add_adapter_to_model("c", LoraConfig(r=16)),
        "unknown": lambda: model.forward_only({}, adapter_name="c"),
        "outside": lambda: model.add_adapter_to_model("c", LoraConfig(r=4, target_modules=["lm_head"])),
        "duplicate": lambda: model.add_adapter_to_model("a", LoraConfig(r=4)),
    }
    if case in ("rank", "outside"):
        model.remove_adapter("b")
    with pytest.raises(UserError) as caught:
        calls[case]()
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_resume_one_adapter_while_another_trains(tiny_model_dir, batches, tmp_path):
    """a is saved inside an open accumulation window while b keeps training; a fresh model where
    a lands in another slot and b has trained resumes a, leaves b as it was, and ends with a's
    weights and optimizer state of the uninterrupted run."""
    save_at = 3  # a's second window is open: its partial gradients are in the checkpoint
    model = make(tiny_model_dir, "a", "b")
    for i, batch in enumerate(batches[:save_at]):
        step(model, "a", batch)
        step(model, "b", batches[-1 - i])
    model.save("a-mid", output_dir=str(tmp_path), adapter_name="a")
    for i, batch in enumerate(batches[save_at:], start=save_at):
        step(model, "b", batches[-1 - i])
        step(model, "a", batch)
    fresh = make(tiny_model_dir, "b")
    add(fresh, "x", spec_of="b")
    add(fresh, "a")
    assert fresh.slots.holder["a"] != model.slots.holder["a"]
    step(fresh, "b", batches[0])
    before_b = snapshot(fresh, "b")
    fresh.resume_from_checkpoint(str(tmp_path / "a-mid"), adapter_name="a")
    assert_states_close(snapshot(fresh, "b")[0], before_b[0], atol=0)
    assert_states_close(snapshot(fresh, "b")[1], before_b[1], atol=0)
    for i, batch in enumerate(batches[save_at:], start=save_at):
        step(fresh, "b", batches[i])
        step(fresh, "a", batch)
    weights, optim = snapshot(fresh, "a")
    expected_weights, expected_optim = snapshot(model, "a")
    assert_states_close(weights, expected_weights)
    assert_states_close(optim, expected_optim)


def test_the_active_slot_runs_fused_and_only_on_its_modules(tiny_model_dir, batches, monkeypatch):
    """The active adapter's layers run as the fused LoRA node, one per target module; the slot's
    layers outside its targets run without it and get no gradient, and nothing of the idle
    adapter moves or gets a gradient."""
    import twinkle.kernel.lora.linear as lora_linear

    model = make(tiny_model_dir, "a", "b")
    fused = []
    original = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", lambda *a: fused.append(1) or original(*a))
    model.forward_backward(inputs=batches[0], adapter_name="b")
    assert len(fused) == 6  # q_proj, v_proj, down_proj in 2 decoder layers
    slot_b, slot_a = model.slots.holder["b"], model.slots.holder["a"]
    targets = set(model.slots.targets["b"])
    for key, layer in model.slots.layers.items():
        grad_b = layer.lora_A[slot_b].weight.grad
        assert (grad_b is not None) == (key in targets), key
        assert layer.lora_A[slot_a].weight.grad is None and layer.lora_B[slot_a].weight.grad is None
    params = {id(p) for p in model.optimizer_group["b"].optimizer.params}
    assert len(params) == 2 * len(targets)
