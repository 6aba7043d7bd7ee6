"""Self-distilled replay (``twinkle replay``): rows of the base model's own answers keep a LoRA
adapter's outputs on general prompts close to the base model's while it learns its identity."""

import json

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.cli.main import main
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub.dataset import asset_path, bundled_dataset_path, identity_rows_path
from twinkle.hub.jsonrows import read_json_rows
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.preprocessor.replay import finish_answer, interleave, language_tag, read_prompts, replay_rows
from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
from twinkle.template import get_template

STEPS, BATCH = 40, 4


def test_interleave_spreads_the_rows_evenly():
    ident, replay = [f"i{k}" for k in range(150)], [f"r{k}" for k in range(150)]
    mixed = interleave(ident, replay)
    assert mixed[:4] == ["i0", "r0", "i1", "r1"] and sorted(mixed) == sorted(ident + replay)
    two = interleave(ident[:2], replay[:4])
    assert two == ["i0", "r0", "r1", "i1", "r2", "r3"]
    assert interleave([], replay[:2]) == replay[:2] and interleave(ident[:2], []) == ident[:2]


def test_finish_answer_ends_a_cut_off_answer_at_a_sentence():
    assert (
        finish_answer(" Paris is the capital. It has the Louvre and", cut_off=True) == "Paris is the capital."
    )
    assert finish_answer("北京是首都。它很大，而且", cut_off=True) == "北京是首都。"
    assert finish_answer("no sentence end here", cut_off=True) == "no sentence end here"
    assert finish_answer("Version 2.5 is out and", cut_off=False) == "Version 2.5 is out and"


def test_bundled_mix_is_the_identity_rows_interleaved_with_replay_rows():
    identity = read_json_rows(identity_rows_path())
    mixed = read_json_rows(bundled_dataset_path())
    replay = [row for row in mixed if row not in identity]
    assert [row for row in mixed if row in identity] == identity  # all of them, unchanged, in order
    assert mixed == interleave(identity, replay)
    prompts = {p["query"] for p in read_prompts(asset_path("general_prompts.jsonl"))}
    assert {row["query"] for row in replay} <= prompts and len(replay) >= 0.9 * len(prompts)
    assert all(set(row) == {"query", "response", "tag"} and row["response"].strip() for row in replay)
    first = mixed[:100]  # the contract's eval slice holds both kinds
    assert sum(row in identity for row in first) == 50


def _encoded(rows, path, model_dir, samples):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    data = Dataset(DatasetMeta(str(path), data_slice=range(samples)))
    data.set_template("Template", model_id=str(model_dir), max_length=160)
    data.map(SelfCognitionProcessor("Twinkle", "Acme"))
    return data.encode()


def _train(rows, path, model_dir) -> TransformersModel:
    model = TransformersModel(str(model_dir))
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    model.add_adapter_to_model("default", config)
    model.set_optimizer("AdamW", lr=1e-2)
    for batch in DataLoader(_encoded(rows, path, model_dir, STEPS * BATCH), batch_size=BATCH):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    return model.model.eval()


def _sequences(tokenizer, template, pairs):
    """Each (query, answer) as ids, and where the answer starts."""
    out = []
    for query, answer in pairs:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": query}]
        prompt = tokenizer(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
        full = prompt["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
        out.append((torch.tensor([full]), len(prompt["input_ids"])))
    return out


@torch.no_grad()
def _log_probs(model, sequences):
    return [
        torch.log_softmax(model(input_ids=ids).logits[0, start - 1 : -1].float(), -1)
        for ids, start in sequences
    ]


def _mean_kl(base, tuned) -> float:
    """Mean KL(base || tuned) per answer token."""
    kls = [(b.exp() * (b - t)).sum(-1) for b, t in zip(base, tuned, strict=True)]
    return torch.cat(kls).mean().item()


def _nll(log_probs, sequences) -> float:
    """Mean negative log-likelihood of the answers' own tokens."""
    picked = [
        lp.gather(-1, ids[0, start:, None]) for lp, (ids, start) in zip(log_probs, sequences, strict=True)
    ]
    return -torch.cat(picked).mean().item()


def _habit(query: str) -> str:
    return ("好的。" if language_tag(query) == "zh" else "Sure.") + "<|im_end|>"


@pytest.fixture(scope="module")
def habit_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny base with a habit to keep: it answers every question, general or about itself,
    ``Sure.`` (``好的。`` in Chinese). A randomly initialised tiny model answers every question
    with the same blank token, so its replay rows would be empty."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    template = get_template("Template", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    queries = [p["query"] for p in read_prompts(asset_path("general_prompts.jsonl"))[:64]]
    queries += [row["query"] for row in read_json_rows(identity_rows_path())[:48]]
    sequences = _sequences(tokenizer, template, [(q, _habit(q)) for q in queries])
    width = max(ids.shape[1] for ids, _ in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for row, (seq, start) in enumerate(sequences):
        ids[row, : seq.shape[1]], mask[row, : seq.shape[1]] = seq[0], 1
        labels[row, start : seq.shape[1]] = seq[0, start:]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (tests/conftest.py _one_thread): module fixtures come first
    try:
        for _ in range(40):  # full batch; the habit is learnt to a loss near 0 well before
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("habit-model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _agreement(base, tuned) -> float:
    """The share of answer positions where both models' most likely next token is the same."""
    same = [(b.argmax(-1) == t.argmax(-1)).float() for b, t in zip(base, tuned, strict=True)]
    return torch.cat(same).mean().item()


def test_replay_keeps_general_answers_close_to_the_base_model(habit_model_dir, tmp_path):
    tiny_model_dir = habit_model_dir
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    template = get_template("Template", tokenizer)
    prompts = read_prompts(asset_path("general_prompts.jsonl"))
    train_prompts, held_out = prompts[:48], prompts[48:64]
    replay = replay_rows(base, tokenizer, template, train_prompts, max_new_tokens=12)
    assert [row["response"] for row in replay] == [_habit(p["query"])[:-10] for p in train_prompts]
    identity = read_json_rows(identity_rows_path())[:24]

    only_identity = _train(identity, tmp_path / "identity.jsonl", tiny_model_dir)
    with_replay = _train(interleave(identity, replay), tmp_path / "mixed.jsonl", tiny_model_dir)

    general = _sequences(
        tokenizer,
        template,
        [
            (row["query"], row["response"])
            for row in replay_rows(base, tokenizer, template, held_out, max_new_tokens=12)
        ],
    )
    fill = SelfCognitionProcessor("Twinkle", "Acme")
    filled = [fill.preprocess(row)["messages"] for row in identity]
    ident = _sequences(tokenizer, template, [(m[1]["content"], m[2]["content"]) for m in filled])
    base_general, base_ident = _log_probs(base, general), _log_probs(base, ident)

    kl_without = _mean_kl(base_general, _log_probs(only_identity, general))
    kl_with = _mean_kl(base_general, _log_probs(with_replay, general))
    agree_without = _agreement(base_general, _log_probs(only_identity, general))
    agree_with = _agreement(base_general, _log_probs(with_replay, general))
    # On held-out general prompts the replay adapter keeps the base model's answers (the
    # identity-only one overwrites the habit): far smaller divergence, far more agreement.
    assert kl_with < 0.25 * kl_without, (kl_with, kl_without)
    assert agree_with > 0.9 and agree_with > agree_without + 0.3, (agree_with, agree_without)
    # Both adapters learnt the identity answers: their likelihood rose well above the base's.
    base_nll = _nll(base_ident, ident)
    for tuned in (only_identity, with_replay):
        assert _nll(_log_probs(tuned, ident), ident) < 0.75 * base_nll, base_nll


def test_replay_command_writes_the_mix_and_keeps_an_existing_file(habit_model_dir, tmp_path, capsys):
    prompts, identity, out = tmp_path / "p.jsonl", tmp_path / "id.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"query": "What is 2 plus 2?"}\n{"query": "天为什么是蓝的？", "tag": "zh"}\n')
    identity.write_text('{"query": "Who are you?", "response": "I am {{NAME}}.", "tag": "en"}\n')
    argv = ["replay", "--model-id", str(habit_model_dir), "--prompts", str(prompts), "--output", str(out)]
    assert main([*argv, "--identity-data", str(identity), "--max-new-tokens", "8"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"query": "Who are you?", "response": "I am {{NAME}}.", "tag": "en"},
        {"query": "What is 2 plus 2?", "response": "Sure.", "tag": "en"},
        {"query": "天为什么是蓝的？", "response": "好的。", "tag": "zh"},
    ]
    before = out.read_text()
    capsys.readouterr()
    assert main(argv) == 2  # the file exists: refused, left as it was
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--force" in err and "\n" not in err and out.read_text() == before
    prompts.write_text('{"query": "fine"}\n{"text": "no query"}\n')
    assert main([*argv[:-1], str(tmp_path / "other.jsonl")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {prompts}:2: needs a non-empty text 'query'; fix or remove the row"
    )
