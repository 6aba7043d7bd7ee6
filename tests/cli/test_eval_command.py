"""``twinkle eval``: a checkpoint's eval loss and accuracy, with the training run's template
settings, equal to ``model.calculate_metric(is_training=False)`` on the same rows."""

import json
import re

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
