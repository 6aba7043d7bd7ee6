"""``twinkle chat``: greedy replies from a base model plus a saved checkpoint."""

from peft import LoraConfig

from twinkle.cli.main import main
from twinkle.model import TransformersModel


def test_chat_with_a_saved_adapter(tiny_model_dir, tmp_path, capsys):
    model = TransformersModel(str(tiny_model_dir))
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-3)
    checkpoint = model.save("ck", output_dir=str(tmp_path))
    argv = ["chat", "--model-id", str(tiny_model_dir), "--prompt", "Who are you?", "--max-new-tokens", "4"]
    assert main([*argv, "--adapter", str(checkpoint)]) == 0
    with_adapter = capsys.readouterr().out
    assert main(argv) == 0
    without = capsys.readouterr().out
    assert with_adapter.startswith("> Who are you?\n") and without.startswith("> Who are you?\n")
    assert with_adapter != without  # the (random, non-zero) adapter changes the greedy reply


def test_chat_refuses_a_folder_without_an_adapter(tiny_model_dir, tmp_path, capsys):
    code = main(["chat", "--model-id", str(tiny_model_dir), "--adapter", str(tmp_path), "--prompt", "hi"])
    assert code == 2
    assert "holds no adapter" in capsys.readouterr().err
