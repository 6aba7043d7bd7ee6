"""Upstream's ``TransformersModel`` methods: ``set_template``/``set_processor`` (raw rows),
``save(interval=)``, ``load``, ``get_state_dict``, ``add_metric``, ``forward_only(adapter_name=)``."""

import pytest
import torch
from safetensors.torch import load_file
from tolerances import gamma

from twinkle.dataloader import DataLoader, collate
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import Accuracy, LossMetric, Metric, TrainMetric
from twinkle.model import InputProcessor
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.utils.errors import UserError


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def chat_rows() -> list[dict]:
    """The fixture dataset's first four rows before encoding: ``{"messages": [...]}``."""
    raw = Dataset(DatasetMeta(None, data_slice=range(4))).map(SelfCognitionProcessor("Twinkle", "Acme"))
    return [raw[i] for i in range(4)]


def test_raw_and_encoded_rows_train_exactly_like_the_dataloader_batch(make_model, dataset, chat_rows):
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    reference, from_chat, from_encoded = make_model(), make_model(), make_model()
    from_chat.set_template("Template", max_length=128)  # the dataset's template and tokenizer
    losses = [
        reference.forward_backward(inputs=batch),
        from_chat.forward_backward(inputs=chat_rows),
        from_encoded.forward_backward(inputs=[dataset[i] for i in range(4)]),
    ]
    for model in (reference, from_chat, from_encoded):
        model.clip_grad_and_step()
    assert losses[0] == losses[1] == losses[2]
    a, b, c = _weights(reference), _weights(from_chat), _weights(from_encoded)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    # forward_only takes rows too, and one row alone
    assert from_chat.forward_only(inputs=chat_rows)["loss"] == reference.forward_only(inputs=batch)["loss"]
    single = from_chat.forward_only(inputs=chat_rows[0], adapter_name="default")["loss"]
    assert single == reference.forward_only(inputs=next(iter(DataLoader(dataset, batch_size=1))))["loss"]


def test_a_custom_processor_and_template_settings(make_model, chat_rows):
    model = make_model()
    seen = []

    def processor(rows):
        seen.append(len(rows))
        return collate(rows, pad_token_id=0)

    model.set_processor(processor)
    model.set_template("Template", max_length=8, truncation_strategy="delete")  # every row too long
    assert model.forward_backward(inputs=chat_rows[:2]) == 0.0  # an empty batch, as a rank's empty share
    model.set_template("Template", max_length=128)
    assert model.forward_backward(inputs=chat_rows[:2]) > 0
    assert seen == [0, 2]
    model.set_processor("InputProcessor", padding_free=True)  # the model packs: honoured
    assert isinstance(model.optimizer_group["default"].processor, InputProcessor)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.forward_backward(inputs=[{"text": "hi"}]), r"input row 0 has neither 'messages' nor"),
        (lambda m: m.forward_backward(inputs="hi"), r"inputs= got str; pass a batch from the DataLoader"),
        (lambda m: m.set_template("Template", flavour=1), r"unknown keyword\(s\) flavour"),
        (lambda m: m.set_template("NoSuch"), r"unknown template 'NoSuch'; valid names: Template"),
        (lambda m: m.set_processor("NoSuch"), r"unknown processor 'NoSuch'; valid names: InputProcessor"),
        (
            lambda m: m.set_processor("InputProcessor", padding_side="middle"),
            r"InputProcessor\(padding_side='middle'\): use one of right, left",
        ),
        (lambda m: m.set_processor("InputProcessor", framework="megatron"), r"not supported yet: megatron"),
        (lambda m: m.forward_only(inputs={}, adapter_name="other"), r"unknown adapter 'other'"),
    ],
)
def test_what_cannot_be_honoured_is_a_user_error(make_model, call, message):
    with pytest.raises(UserError, match=message):
        call(make_model())


def test_a_processor_must_return_a_batch(make_model, chat_rows):
    model = make_model()
    model.set_processor(lambda rows: {"input_ids": 1})
    with pytest.raises(UserError, match=r"returned no tensor for \['input_ids', 'labels'"):
        model.forward_backward(inputs=chat_rows[:1])


def test_padding_free_processor_needs_a_packing_model(tiny_model_dir):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(str(tiny_model_dir), padding_free=False)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(UserError, match=r"build it with TransformersModel\(padding_free=True\)"):
        model.set_processor("InputProcessor", padding_free=True)


def test_save_interval_and_default_name(make_model, dataset, tmp_path):
    model = make_model()
    saved = []
    for batch in list(DataLoader(dataset, batch_size=4))[:4]:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        saved.append(model.save(output_dir=str(tmp_path), interval=2))
    assert saved[0] is None and saved[2] is None
    assert saved[1] == tmp_path / "checkpoint-2" and saved[3] == tmp_path / "checkpoint-4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    with pytest.raises(UserError, match=r"interval must be a positive integer"):
        model.save("x", output_dir=str(tmp_path), interval=0)


def test_load_restores_weights_and_optimizer_but_not_the_counters(make_model, dataset, tmp_path):
    batches = list(DataLoader(dataset, batch_size=4))[:3]
    trained = make_model(init_lora_weights=False)
    trained.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=3)
    for batch in batches[:2]:
        trained.forward_backward(inputs=batch)
        trained.clip_grad_and_step()
    path = trained.save("ck", output_dir=str(tmp_path))
    state = trained.get_state_dict()
    on_disk = load_file(path / "adapter_model.safetensors")
    assert state.keys() == on_disk.keys() and all(torch.equal(state[k], on_disk[k]) for k in state)

    fresh = make_model(init_lora_weights=False)
    fresh.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=3)
    assert not all(torch.equal(fresh.get_state_dict()[k], state[k]) for k in state)
    assert fresh.load("ck", output_dir=str(tmp_path), load_optimizer=True) == path
    loaded = fresh.get_state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert fresh.optimizer_group["default"].cur_step == 0  # load is weights (+ optimizer), not a resume
    # with the optimizer and schedule restored, the next step is the trained model's next step
    assert fresh.forward_backward(inputs=batches[2]) == trained.forward_backward(inputs=batches[2])
    fresh.clip_grad_and_step()
    trained.clip_grad_and_step()
    a, b = _weights(trained), _weights(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_a_peft_folder_and_the_errors(make_model, tmp_path):
    source = make_model(init_lora_weights=False)
    source.model.save_pretrained(str(tmp_path / "peft"))
    target = make_model()
    target.load(str(tmp_path / "peft"))
    state = target.get_state_dict()
    assert all(torch.equal(state[k], v) for k, v in source.get_state_dict().items())
    with pytest.raises(UserError, match=r"holds no optimizer state .*load it with load_optimizer=False"):
        target.load(str(tmp_path / "peft"), load_optimizer=True)
    with pytest.raises(UserError, match=r"is not a folder"):
        target.load("nope", output_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"holds no LoRA adapter"):
        target.load(str(tmp_path))
    with pytest.raises(UserError, match=r"holds a LoRA adapter \{'r': 4.*adapter 'default' is \{'r': 8"):
        make_model(r=8).load(str(tmp_path / "peft"))


class Recorder(Metric):
    """Keeps the context of every micro-batch it is given."""

    def __init__(self, device_mesh=None, process_group=None):
        super().__init__(device_mesh, process_group)
        self.seen = []

    def accumulate(self, inputs, outputs, **kwargs):
        self.seen.append((int((inputs["labels"] != -100).sum()), outputs["num_tokens"], kwargs))

    def calculate(self):
        return {"recorded": len(self.seen)}


def test_added_metrics_report_alongside_the_built_in_ones(make_model, dataset):
    batches = list(DataLoader(dataset, batch_size=4))[:4]
    plain, measured = make_model(gradient_accumulation_steps=2), make_model(gradient_accumulation_steps=2)
    recorder = Recorder()
    measured.add_metric("Accuracy")  # both training and evaluation
    measured.add_metric(LossMetric, is_training=True)
    measured.add_metric(TrainMetric(), is_training=True)
    measured.add_metric(recorder, is_training=True)
    losses = {id(m): [] for m in (plain, measured)}
    for model in (plain, measured):
        for batch in batches:
            losses[id(model)].append(model.forward_backward(inputs=batch))
            model.clip_grad_and_step()
    assert losses[id(plain)] == losses[id(measured)]  # metrics never change training
    base, added = plain.calculate_metric(is_training=True), measured.calculate_metric(is_training=True)
    # the same fp32 loss sums, added and divided in float64 by the metric or the model: a few
    # float64 roundings apart (2 gamma(4), ~1e-15); a batch left out or counted twice is percents
    assert added["loss"] == pytest.approx(base["loss"], rel=2 * gamma(4, torch.float64), abs=0)
    assert added["accuracy"] == base["accuracy"] and added["total_tokens"] == base["supervised_tokens"]
    assert added["grad_norm"] == base["grad_norm"] and added["iters"] == base["optimizer_steps"] == 2
    assert added["lr"] == base["lr"] and added["recorded"] == 4
    # every micro-batch was given with the step that used it: labels shifted, the window's grad norm
    group = measured.optimizer_group["default"]
    tokens = [n for n, _, _ in recorder.seen]
    assert tokens == [n for _, n, _ in recorder.seen] and sum(tokens) == base["supervised_tokens"]
    assert recorder.seen[-1][2]["grad_norm"] == group.last_grad_norm and recorder.seen[-1][2]["step"] == 4
    for batch in batches[:2]:
        measured.forward_only(inputs=batch)
        measured.calculate_loss()
    evaluation = measured.calculate_metric(is_training=False)
    assert evaluation["total_tokens"] == evaluation["supervised_tokens"] and "iters" not in evaluation


def test_add_metric_errors(make_model):
    model = make_model()
    with pytest.raises(
        UserError, match=r"unknown metric 'Nope'; valid names: Accuracy, LossMetric, TrainMetric"
    ):
        model.add_metric("Nope")
    with pytest.raises(UserError, match=r"a metric instance and keywords \['x'\]"):
        model.add_metric(Accuracy(), x=1)
    with pytest.raises(UserError, match=r"metric Accuracy: .*'x'"):
        model.add_metric(Accuracy, x=1)
