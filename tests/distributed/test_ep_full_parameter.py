"""Full-parameter training under expert parallelism: 2 gloo ranks (ep_size 2 over 2 FSDP2 shards),
4 (ep_size 2, two ranks per block), and 2 with Ulysses 2 beside it, equal one process, for a tiny
Qwen3-MoE (2 layers, hidden 64, 4 experts, top-2).

``ep_full_worker.py`` trains every weight for 3 AdamW steps on 4 chat samples (each rank its
share, and 2 of the 4 experts of each MoE layer), clipping at 1.0. Each rank's expert blocks
train there: their gradients come back through the exchange from every rank's tokens, their
share of the gradient norm is counted once, AdamW steps them in place. Checked:

- per-step losses and gradient norms agree within ``run_loss_rtol`` (the same sums in another
  order: the tiny model's chain over the batch and the ranks' reduction), relative; the experts'
  gradients without FSDP2's average over the ranks (twice too large on 2 ranks) move the first
  gradient norm about 100 times past it;
- the checkpoint saved after the steps holds every expert and equals one process's weights within
  ``adamw_weight_atol``; ``from_pretrained`` loads it, and its logps of rank 0's rows are the ones
  the ranks computed before the save (same weights, the sums in another order: ``run_loss_rtol``);
- each rank holds its own block of that checkpoint's experts, exactly, and ``get_state_dict``
  gives the whole experts;
- the step after a resume from the step-2 checkpoint repeats the uninterrupted step 3 (the
  optimizer's state gathered to full size on the save and sliced back on the load): the same
  arithmetic on the same ranks, so exactly equal;
- the trainable count is one process's (every expert once)"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, run_loss_rtol

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # 2-process runs, with the other `-m cluster` suites

WORKER = Path(__file__).with_name("ep_full_worker.py")
STEPS, LR, EXPERTS = 3, 1e-3, 4  # as ep_full_worker.py runs them


def _tiny_qwen3_moe(tiny_model_dir: Path, out: Path) -> Path:
    import transformers

    ids = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=64,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        **{k: ids.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")},
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


def _run(launcher, model_dir: Path, out: Path, nproc: int, ulysses: int = 1) -> dict:
    out.mkdir()
    args = ["--model-id", str(model_dir), "--out", str(out), "--steps", str(STEPS)]
    if nproc > 1:
        args += ["--ep-size", "2", "--ulysses-size", str(ulysses)]
    job = launcher.run(WORKER, args, nproc=nproc, timeout_s=240)  # a hang ends here
    assert job.returncode == 0, job.output[-6000:]
    return json.loads((out / "result.json").read_text())


def _label_logps(model, rows: dict) -> torch.Tensor:
    """``forward_only``'s ``logps``: each label's log-probability from the position before it."""
    ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.tensor(rows["attention_mask"])).logits
    targets = labels[:, 1:]
    picked = logits[:, :-1].float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    out = torch.zeros(labels.shape)
    out[:, 1:] = picked.masked_fill(targets == -100, 0.0)
    return out


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory, launcher) -> tuple[Path, Path, dict]:
    """The model's folder, and the one-process run's folder and result (both cases compare to it)."""
    root = tmp_path_factory.mktemp("ep-full")
    model_dir = _tiny_qwen3_moe(tiny_model_dir, root / "moe")
    return model_dir, root / "one", _run(launcher, model_dir, root / "one", 1)


# 4 ranks: experts 0-1 on ranks 0 and 1, 2-3 on ranks 2 and 3; the two ranks holding a block
# all-reduce its gradient (tokens go between ranks 0 and 2, 1 and 3). Ulysses 2 beside EP 2 on 2
# ranks: both read every sample, each runs half the positions through its attention and experts.
@pytest.mark.parametrize(("ranks", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_full_parameter_under_expert_parallelism_equals_one_process(
    one_process, tmp_path, launcher, ranks, ulysses
):
    from transformers import AutoModelForCausalLM

    model_dir, one_dir, one = one_process
    many = _run(launcher, model_dir, tmp_path / "many", ranks, ulysses)
    assert many["world_size"] == ranks
    lengths = [sum(mask) for mask in one["rows"]["attention_mask"]]
    rtol = run_loss_rtol(len(lengths), max(lengths), ranks)
    losses = [[s["loss"] for s in run["steps"]] for run in (one, many)]
    print(f"\n[ep 2 on {ranks}, full-parameter] {losses[0]} vs {losses[1]}")
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]  # it trained
    assert one["steps"][0]["grad_norm"] > 1.0  # so the clipping at 1.0 acted on both kinds of weights
    for a, b in zip(one["steps"], many["steps"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rtol * max(1.0, abs(a[key])), (key, a[key], b[key], rtol)
    for run in (one, many):  # resumed from the step-2 checkpoint, step 3 is the uninterrupted step 3
        assert run["resumed"] == run["steps"][-1], (run["resumed"], run["steps"][-1])
    assert one["trainable"] == many["trainable"]

    folders = {"one": one_dir, "many": tmp_path / "many"}
    files = {n: load_file(f / "final" / "model.safetensors") for n, f in folders.items()}
    assert files["one"].keys() == files["many"].keys()  # the same Hugging Face layout (tied head once)
    final = {
        n: AutoModelForCausalLM.from_pretrained(f / "final", dtype=torch.float32) for n, f in folders.items()
    }
    weights = {n: dict(m.named_parameters()) for n, m in final.items()}
    assert weights["one"].keys() == weights["many"].keys()
    assert sum(p.numel() for p in weights["one"].values()) == one["trainable"]
    atol = adamw_weight_atol(LR, STEPS)
    for name, p in weights["one"].items():
        torch.testing.assert_close(
            weights["many"][name], p, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the checkpoint is the model the ranks trained: its logps of rank 0's rows are theirs
    saved = _label_logps(final["many"], many["rows"])
    for row_a, row_b in zip(many["logps"], saved.tolist(), strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert abs(x - y) <= rtol * max(1.0, abs(x)), (x, y, rtol)

    experts = {
        n: p for n, p in weights["many"].items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    assert len(experts) == 4 and all(p.shape[0] == EXPERTS for p in experts.values())
    held_one = load_file(one_dir / "experts-0.safetensors")
    assert {k: v.shape for k, v in held_one.items()} == {k: v.shape for k, v in experts.items()}
    for rank in range(ranks):  # ep_rank b holds experts 2b, 2b + 1 of every MoE layer, as saved
        held = load_file(tmp_path / "many" / f"experts-{rank}.safetensors")
        assert held.keys() == experts.keys()
        b = rank // (ranks // 2)
        for name, full in experts.items():
            block = full.detach()[b * EXPERTS // 2 : (b + 1) * EXPERTS // 2]
            assert torch.equal(held[name], block), (rank, name)
    # get_state_dict() gives every rank the whole experts too
    whole = load_file(tmp_path / "many" / "state-dict-experts.safetensors")
    assert whole.keys() == experts.keys()
    assert all(torch.equal(whole[name], full.detach()) for name, full in experts.items())
