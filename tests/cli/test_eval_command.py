"""``twinkle eval``: a checkpoint's eval loss and accuracy, with the training run's template
settings and the loss the checkpoint records (its class and arguments), equal to
``model.calculate_metric(is_training=False)`` on the same rows."""

import json
import re

import pytest
from batches import padded_batches
from shared_data import build_dataset

from twinkle.cli.main import main
from twinkle.dataloader import DataLoader


def test_eval_prints_the_models_own_metrics(tiny_model_dir, make_model, tmp_path, capsys):
    model = make_model(init_lora_weights=False)  # a non-zero adapter: its weights must be loaded
    checkpoint = model.save("checkpoint-1", output_dir=str(tmp_path / "out"))
    run_args = {  # what a CLI run leaves next to its checkpoints (twinkle.metric.report)
        "model": {"model_id": str(tiny_model_dir)},
        "template": {"template_cls": "Template", "max_length": 128, "truncation_strategy": "right"},
        "training": {"batch_size": 4},
        "extra": {"model_name": "Twinkle", "model_author": "Acme"},
    }
    (tmp_path / "out" / "run_args.json").write_text(json.dumps(run_args))
    for batch in DataLoader(dataset=build_dataset(tiny_model_dir, 8), batch_size=4):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    expected = model.calculate_metric(is_training=False)

    assert main(["eval", "--adapter", str(checkpoint), "--eval-samples", "8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.fullmatch(
        r"eval loss ([\d.]+), accuracy ([\d.]+) \((\d+) samples, (\d+) supervised tokens\)", line
    )
    assert found, line
    assert float(found[1]) == round(expected["loss"], 4)
    assert float(found[2]) == round(expected["accuracy"], 4)
    assert (int(found[3]), int(found[4])) == (8, expected["supervised_tokens"])


def test_eval_refuses_a_folder_without_an_adapter(tmp_path, capsys):
    assert main(["eval", "--adapter", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "holds no adapter" in err and "\n" not in err


def test_a_dpo_checkpoint_of_your_own_pairs_needs_the_held_out_count(make_model, tmp_path, capsys):
    """A checkpoint trained with DPOLoss is evaluated on held-out pairs; of a set of your own, those
    are its first --eval-samples pairs, so without the run's count (no run_args.json) it is one
    line that says what to pass, before any model loads."""
    from twinkle.loss import DPOLoss

    model = make_model()
    model.set_loss(DPOLoss(beta=0.1))
    checkpoint = model.save("checkpoint-1", output_dir=str(tmp_path / "out"))
    assert json.loads((checkpoint / "trainer_state.json").read_text())["loss"] == "DPOLoss"
    assert main(["eval", "--adapter", str(checkpoint), "--dataset-id", str(tmp_path / "mine.jsonl")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert line.startswith("error: ") and "held no pair" in line and "--eval-samples N" in line, line


def test_more_samples_than_the_set_holds_counts_each_row_once(tiny_model_dir, make_model, tmp_path, capsys):
    from twinkle.dataset import Dataset, DatasetMeta

    checkpoint = make_model().save("checkpoint-1", output_dir=str(tmp_path / "out"))
    rows = len(Dataset(dataset_meta=DatasetMeta(None)))  # the bundled set
    argv = ["eval", "--adapter", str(checkpoint), "--model-id", str(tiny_model_dir), "--max-length", "64"]
    assert main([*argv, "--eval-samples", str(rows + 50), "--batch-size", "32"]) == 0
    assert f"({rows} samples," in capsys.readouterr().out.strip().splitlines()[-1]


RUN_ARGS = {  # what a CLI run leaves next to its checkpoints (twinkle.metric.report)
    "template": {"template_cls": "Template", "max_length": 128, "truncation_strategy": "right"},
    "training": {"batch_size": 4},
    "extra": {"model_name": "Twinkle", "model_author": "Acme"},
}


def _own_metrics(model, tiny_model_dir) -> dict:
    for batch in DataLoader(dataset=build_dataset(tiny_model_dir, 8), batch_size=4):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def test_eval_rebuilds_the_recorded_loss_with_its_arguments(tiny_model_dir, make_model, tmp_path, capsys):
    """The checkpoint records the loss's class and arguments (here a label left out of the loss);
    ``twinkle eval`` rebuilds that loss, so it prints the model's own metrics under it."""
    model = make_model(init_lora_weights=False)
    labels = next(iter(padded_batches(build_dataset(tiny_model_dir, 8), batch_size=8)))["labels"]
    common = int(labels[labels != -100].mode().values)  # the most frequent label: it moves the loss
    default = _own_metrics(model, tiny_model_dir)
    model.set_loss("CrossEntropyLoss", ignore_index=common, reduction="sum")
    checkpoint = model.save("checkpoint-1", output_dir=str(tmp_path / "out"))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["loss"] == "CrossEntropyLoss"
    assert state["loss_args"] == {"ignore_index": common, "reduction": "sum", "dft": False}
    run_args = {**RUN_ARGS, "model": {"model_id": str(tiny_model_dir)}}
    (tmp_path / "out" / "run_args.json").write_text(json.dumps(run_args))
    expected = _own_metrics(model, tiny_model_dir)
    assert round(expected["loss"], 4) != round(default["loss"], 4)

    assert main(["eval", "--adapter", str(checkpoint), "--eval-samples", "8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.fullmatch(
        r"eval loss ([\d.]+), accuracy ([\d.]+) \((\d+) samples, (\d+) supervised tokens\)", line
    )
    assert found, line
    assert (float(found[1]), float(found[2])) == (round(expected["loss"], 4), round(expected["accuracy"], 4))


def _saved_with(make_model, tmp_path, capsys, loss):
    model = make_model()
    model.set_loss(loss)
    checkpoint = model.save("checkpoint-1", output_dir=str(tmp_path / "out"))
    capsys.readouterr()  # the model's loading bar
    return checkpoint


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err  # before any model loads
    return err


def test_a_loss_eval_cannot_rebuild_is_one_line_naming_the_registered_ones(make_model, tmp_path, capsys):
    from twinkle.loss import LOSSES
    from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss

    checkpoint = _saved_with(make_model, tmp_path, capsys, TokenWeightedCrossEntropyLoss())
    assert main(["eval", "--adapter", str(checkpoint)]) == 2
    err = _one_line_error(capsys)
    assert f"{checkpoint / 'trainer_state.json'} records the loss 'TokenWeightedCrossEntropyLoss'" in err
    assert err.endswith(f"it rebuilds the registered losses: {', '.join(LOSSES)}"), err


def test_a_loss_that_reads_sampled_inputs_is_one_line(make_model, tmp_path, capsys):
    checkpoint = _saved_with(make_model, tmp_path, capsys, "GRPOLoss")
    assert main(["eval", "--adapter", str(checkpoint)]) == 2
    assert "trained with GRPOLoss, which reads old_logps, advantages besides the rows" in _one_line_error(
        capsys
    )


def _state(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"cur_step": 1, **fields}))
    return folder


def test_trained_loss_reads_the_record_and_keeps_older_checkpoints_loading(tmp_path):
    from twinkle.cli.from_checkpoint import trained_loss
    from twinkle.utils.errors import UserError

    run = {"beta": 0.3, "loss_type": "ipo", "max_length": 64}  # the run's settings (run_args.json)
    assert trained_loss(_state(tmp_path / "none"), run) is None  # the model's default loss
    recorded = trained_loss(
        _state(tmp_path / "new", loss="SimPOLoss", loss_args={"beta": 2.0, "gamma": 0.1}), run
    )
    assert type(recorded).__name__ == "SimPOLoss" and (recorded.beta, recorded.gamma) == (2.0, 0.1)
    # a DPO checkpoint without recorded arguments takes the run's; any other loss its defaults
    dpo = trained_loss(_state(tmp_path / "old-dpo", loss="DPOLoss"), run)
    assert (dpo.beta, dpo.loss_type) == (0.3, "ipo")
    assert trained_loss(_state(tmp_path / "old-cpo", loss="CPOLoss"), run).beta == 0.1
    path = tmp_path / "bad" / "trainer_state.json"
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}: 'loss_args' is \[1\], not an object"):
        trained_loss(_state(tmp_path / "bad", loss="DPOLoss", loss_args=[1]), run)
    with pytest.raises(
        UserError, match=r"its 'loss_args' do not build DPOLoss \(DPOLoss: beta must be above 0"
    ):
        trained_loss(_state(tmp_path / "bad", loss="DPOLoss", loss_args={"beta": -1}), run)
    with pytest.raises(UserError, match=r"its 'loss_args' do not build DPOLoss \(loss DPOLoss: .*'gamma'"):
        trained_loss(_state(tmp_path / "bad", loss="DPOLoss", loss_args={"gamma": 1}), run)


def test_a_reference_free_preference_loss_is_evaluated_on_pairs(tiny_model_dir, make_model, tmp_path, capsys):
    """SimPO reads no reference: the pairs run through the adapter only, and the line gives the
    share of pairs the loss prefers the chosen row of, with the rows' mean log-probabilities;
    the loss is the recorded one (its beta and gamma), the numbers the model's own on those pairs."""
    from twinkle.cli.evaluate_pairs import evaluate_pairs
    from twinkle.loss import SimPOLoss

    checkpoint = _saved_with(make_model, tmp_path, capsys, SimPOLoss(beta=1.5, gamma=0.2))
    argv = ["eval", "--adapter", str(checkpoint), "--model-id", str(tiny_model_dir), "--max-length", "64"]
    assert main([*argv, "--eval-samples", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.fullmatch(
        r"eval loss (\S+), pair accuracy (\S+), chosen logps (\S+), rejected logps (\S+) \(4 pairs\)", line
    )
    assert found, line
    pipeline = dict(
        model_id=str(tiny_model_dir),
        dataset_id=None,
        split=None,
        pairs=4,
        batch_size=4,
        template_cls="Template",
        max_length=64,
        truncation_strategy="right",
        model_name="twinkle大模型",
        model_author="ModelScope社区",
    )
    expected = evaluate_pairs(checkpoint, loss=SimPOLoss(beta=1.5, gamma=0.2), **pipeline)
    assert float(found[1]) == round(expected["loss"], 4) and "reward_margin" not in expected
    default = evaluate_pairs(checkpoint, loss=SimPOLoss(), **pipeline)
    assert round(default["loss"], 4) != round(expected["loss"], 4)
