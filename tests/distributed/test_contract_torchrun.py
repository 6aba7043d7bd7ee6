"""The verbatim contract script under torchrun (FSDP2 over 2 gloo ranks) logs the same losses as
one process, and leaves a complete last checkpoint with a state file per rank.

Flags beyond the brief's run: ``--lora-dropout 0`` because dropout masks come from each
process's own random stream, so 1 and 2 processes draw different masks by design and their
losses could not be compared tightly; ``--lr 1e-2 --num-warmup-steps 1`` so that the adapter
moves enough in 4 steps for the comparison to mean something (the default 1e-4 with 5 warm-up
steps barely changes the loss).

Tolerance, derived (tests/assets/tolerances.py ``run_loss_rtol``): 2 ranks sum the same terms in
another order, so each logged loss (a batch of 4 rows, or the eval loss over 8, of at most the
script's max_length of 1024 tokens) is within Higham and Mary's probabilistic bound of the tiny
model's chain of sums, ~1.3e-4 relative (8e-4 of 6.4). torch's Muon runs its Newton-Schulz in
bf16, so a last-bit difference in a gradient can flip a bf16 rounding of that step's update: one
element by 2^-7 of it (~1e-4 of a weight), which moves the loss by that times its gradient,
far below the bound. A rank's rows dropped or counted twice move a loss by percents."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port
from tolerances import run_loss_rtol

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook/transformers/fsdp2.py"
STEP_LINE = re.compile(r"Current is step (\d+) of (\d+), metric: \{.*'loss': ([^,]+),")
EVAL_LINE = re.compile(r"Eval metric: \{'loss': ([^,]+),")
LOSS_RTOL = run_loss_rtol(rows=8, tokens=1024, ranks=2)


def contract_args(model_dir: Path, output_dir: Path) -> list[str]:
    return [
        "--model-id", str(model_dir), "--train-samples", "16", "--batch-size", "4",
        "--eval-samples", "8", "--eval-interval", "2", "--log-interval", "1",
        "--output-dir", str(output_dir),
        "--lora-dropout", "0", "--lr", "1e-2", "--num-warmup-steps", "1",
    ]  # fmt: skip


def logged_losses(output: str) -> tuple[dict[int, float], list[float]]:
    """Training loss per step and the eval losses, from the lines rank 0 logs."""
    train = {}
    for step, total, loss in STEP_LINE.findall(output):
        assert int(total) == 4
        assert int(step) not in train, f"step {step} logged twice"
        train[int(step)] = float(loss)
    return train, [float(x) for x in EVAL_LINE.findall(output)]


def loss_diffs(train_1: dict, train_2: dict, eval_1: list, eval_2: list) -> list[float]:
    """The relative differences of the logged training losses, step by step, and eval losses."""
    pairs = [(train_1[s], train_2[s]) for s in train_1] + list(zip(eval_1, eval_2, strict=True))
    return [abs(a - b) / abs(a) for a, b in pairs]


def test_contract_fsdp2_two_ranks_matches_one_process(baseline):
    single, sharded, tmp_path = baseline
    print(f"\n[contract] 1 process {single.wall_s:.1f} s, 2 ranks {sharded.wall_s:.1f} s")
    assert "1 replica(s) x 2 shard(s) = 2 ranks" in sharded.output

    last = tmp_path / "two" / "last-checkpoint"
    assert (last / ".twinkle-complete").is_file()
    assert (last / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in last.glob("rank_state_rank*.pt")) == [
        "rank_state_rank0.pt",
        "rank_state_rank1.pt",
    ]

    train_1, eval_1 = logged_losses(single.output)
    train_2, eval_2 = logged_losses(sharded.output)
    assert sorted(train_1) == sorted(train_2) == [1, 2, 3, 4]
    assert len(eval_1) == len(eval_2) == 2
    assert train_1[4] < train_1[1] - 1e-3, train_1  # it trained, so equal losses say something
    diffs = loss_diffs(train_1, train_2, eval_1, eval_2)
    print(f"[contract] max loss diff {max(diffs):.2e} relative (train {train_1}, eval {eval_1})")
    assert max(diffs) <= LOSS_RTOL, (train_1, train_2, eval_1, eval_2)


@pytest.mark.cluster
def test_two_torchrun_agents_meeting_on_localhost_match_one_node(tiny_model_dir, tmp_path, launcher):
    """``--nnodes 2 --nproc_per_node 1``: two agents, one rank each, as on two machines."""
    one_node = launcher.run(
        SCRIPT, [*contract_args(tiny_model_dir, tmp_path / "one"), "--fsdp-size", "2"], nproc=2
    )
    assert one_node.returncode == 0, one_node.output[-4000:]
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(SCRIPT),
                *contract_args(tiny_model_dir, tmp_path / "two"),
                "--fsdp-size",
                "2",
            ],
            cwd=SCRIPT.parent,
            env=launcher.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    train_1, eval_1 = logged_losses(one_node.output)
    train_2, eval_2 = logged_losses(outputs[0])  # node 0 holds rank 0, which logs
    assert sorted(train_1) == sorted(train_2) == [1, 2, 3, 4]
    assert max(loss_diffs(train_1, train_2, eval_1, eval_2)) <= LOSS_RTOL, (train_1, train_2)


def test_the_ddp_strategy_matches_one_process(tiny_model_dir, tmp_path, launcher, baseline):
    """``--strategy ddp`` (upstream's DDP): a whole model per rank, the same losses as one process."""
    single = baseline[0]
    ddp = launcher.run(
        SCRIPT,
        [*contract_args(tiny_model_dir, tmp_path / "ddp"), "--strategy", "ddp", "--dp-size", "2"],
        nproc=2,
    )
    assert ddp.returncode == 0, ddp.output[-4000:]
    train_1, eval_1 = logged_losses(single.output)
    train_2, eval_2 = logged_losses(ddp.output)
    assert sorted(train_1) == sorted(train_2) == [1, 2, 3, 4]
    assert max(loss_diffs(train_1, train_2, eval_1, eval_2)) <= LOSS_RTOL, (train_1, train_2)
