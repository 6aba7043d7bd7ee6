"""Multi-turn GRPO through ``twinkle_client``: ``multi_turn_grpo.py``'s arithmetic tool task, the
rollouts sampled and the adapter trained by ``twinkle server``.

    python cookbook/rl/multi_turn_grpo_client.py                 # starts a server for the run
    python cookbook/rl/multi_turn_grpo_client.py --base-url http://127.0.0.1:8000
    TWINKLE_SERVER_URL=http://127.0.0.1:8000 python cookbook/rl/multi_turn_grpo_client.py

With neither ``--base-url`` nor ``TWINKLE_SERVER_URL`` it starts ``twinkle server`` without keys
on a free loopback port as a child process (serving ``--model-id``, default the bundled
SmolLM2-135M-Instruct, its runs and checkpoints under ``<output-dir>/server``) and stops it at the
end, also when the run fails. A running server is reached with ``TWINKLE_SERVER_TOKEN`` (default
``EMPTY_TOKEN``, what a server without keys takes).

The task, prompts, rewards and sizes are ``multi_turn_task``'s, as in ``multi_turn_grpo.py``,
with 16 held-out questions rather than 24: the server samples each reply as a request of its own.
Every step: ``save(name, is_sampler=True)`` the adapter (the server samples from a saved
checkpoint), play the episodes with ``ClientMultiTurnRollout`` through ``vLLMSampler`` on that
checkpoint (the environments and tools run here), ``GRPOAdvantage`` per group,
``forward_backward(inputs=trajectories, old_logps=..., advantages=...)`` with the server's
``GRPOLoss`` and ``clip_grad_and_step()``. Each step logs the trajectories' generated tokens
beside the tokens the server trained on (only the model's own tokens carry labels, so the two
are equal) and the largest gap between the server's log-prob of a trained token and the
sampler's (the same weights: near 0). The held-out greedy success is measured before training and at the end.

The server's LoRA is on every linear layer, alpha 32, no dropout; only ``--lora-r`` travels.
"""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from multi_turn_task import DEFAULTS, MAX_TURNS, evaluate, play, sizes, success

from twinkle import get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.utils.errors import UserError
from twinkle_agentic.envs import ArithmeticEnv, EnvPool
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.rollout import ClientMultiTurnRollout
from twinkle_client.sampler import vLLMSampler

STARTUP_S = 300  # loading the model on a shared CPU
# The server samples one request of a key at a time, so each reply is a request of its own (no
# batch across trajectories as with the local sampler): 16 held-out questions rather than 24 keep
# the two evaluations short. With 2 questions x 4 trajectories a step, most steps had no
# successful trajectory at all (equal rewards: no gradient), so the steps keep the local sizes.
CLIENT_DEFAULTS = {**DEFAULTS, "held_out": 16}


def pop_flag(flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``), taken out of ``sys.argv`` (it is this
    script's own, not a training flag)."""
    argv, value, rest = sys.argv[1:], None, []
    while argv:
        a = argv.pop(0)
        if a == flag:
            if not argv:
                raise SystemExit(f"error: {flag} needs a value")
            value = argv.pop(0)
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    sys.argv[1:] = rest
    return value


BASE_URL = pop_flag("--base-url") or os.environ.get("TWINKLE_SERVER_URL")
logger = get_logger()
args = CLI.from_args()
MAX_STEPS, MAX_TOKENS, BATCH, G, WARMUP, HELD_OUT = sizes(args, CLIENT_DEFAULTS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server() -> Iterator[str]:
    """The server's URL: ``BASE_URL``, else a keyless child ``twinkle server`` stopped on exit."""
    if BASE_URL:
        yield BASE_URL
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "twinkle.server", "--port", str(port),
               "--output-dir", str(Path(args.training.output_dir) / "server")]  # fmt: skip
    if args.model.model_id:
        command += ["--model-id", args.model.model_id]
    env = {k: v for k, v in os.environ.items() if k != "TWINKLE_API_KEYS"}  # without keys: loopback only
    log = Path(args.training.output_dir) / "server" / "server.log"  # one line per request: not here
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(child, url, log)
        logger.info(f"twinkle server (pid {child.pid}) at {url}, its log in {log}")
        yield url
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def wait_ready(child: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            last = (log.read_text().strip().splitlines() or [""])[-1]
            raise UserError(f"twinkle server exited with status {child.returncode} before it served: {last}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.5)
    raise UserError(f"twinkle server did not answer at {url} within {STARTUP_S} s")


class OnCheckpoint:
    """``vLLMSampler`` on the checkpoint last saved for sampling (``path``; None: the base
    model). Each row goes with its own seed: the server seeds every request alone, so the rows
    of a group, which share their prompt, would draw the same tokens under one seed."""

    def __init__(self, sampler: vLLMSampler):
        self.sampler, self.path = sampler, None
        self.template = sampler.template

    def sample(self, rows: list[dict], sampling_params: dict[str, Any]) -> list[Any]:
        seed = sampling_params.get("seed")
        out = []
        for i, row in enumerate(rows):
            params = sampling_params if seed is None else {**sampling_params, "seed": seed * 1024 + i}
            out += self.sampler.sample([row], params, adapter_uri=self.path)
        return out


def trained_against_sampled(records: list[dict], logps: torch.Tensor) -> tuple[int, float]:
    """The tokens the server trained on (those with a label), and the largest gap between its
    log-prob of each (``forward_backward``'s ``logps``, under the weights the step's rollouts
    were sampled with) and the sampler's; inf when the trained tokens are not the sampled ones."""
    count, gap = 0, 0.0
    for row, record in zip(logps, records, strict=True):
        labels = torch.tensor(record["labels"])
        trained = row[: len(labels)][labels != -100]
        sampled = torch.tensor(record["old_logps"], dtype=trained.dtype)
        count += trained.numel()
        if trained.numel() != sampled.numel():
            gap = float("inf")
        elif trained.numel():
            gap = max(gap, float((trained - sampled).abs().max()))
    return count, gap


def build_model() -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model(args.lora.adapter_name, {"r": args.lora.lora_r})
    model.set_optimizer(args.optimizer.optimizer_cls, lr=args.optimizer.learning_rate)
    model.set_lr_scheduler(
        args.scheduler.scheduler_cls, num_warmup_steps=WARMUP, num_training_steps=MAX_STEPS
    )
    model.set_loss("GRPOLoss", epsilon=args.loss.epsilon, epsilon_high=args.loss.epsilon_high)
    return model


def train(rollout: ClientMultiTurnRollout, sampler: OnCheckpoint, pool: EnvPool) -> None:
    model = build_model()
    base = evaluate(rollout, pool, HELD_OUT, MAX_TOKENS)  # no checkpoint yet: the base model
    logger.info(f"held-out greedy success before training: {base:.3f}")
    order = random.Random(args.infra.seed)
    for step in range(1, MAX_STEPS + 1):
        t0 = time.perf_counter()
        sampler.path = model.save(f"sampler-{step}", is_sampler=True).twinkle_path
        questions = [order.randrange(1_000_000) for _ in range(BATCH)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=args.sampling.temperature, seed=step)
        records = play(rollout, pool, [q for q in questions for _ in range(G)], params)
        rewards = [r["reward"] for r in records]
        advantages = GRPOAdvantage()(rewards, num_generations=G, scale=args.rl.advantage_scale).tolist()
        calls = [float(r["tool_calls"] > 0 and r["tool_errors"] == 0) for r in records]
        t1 = time.perf_counter()
        fb = model.forward_backward(
            inputs=records, old_logps=[r["old_logps"] for r in records], advantages=advantages
        )
        model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
        trained, gap = trained_against_sampled(records, fb.result["logps"])
        out = model.calculate_metric(is_training=True).result
        logger.info(
            f"step {step}/{MAX_STEPS} ({time.perf_counter() - t0:.1f}s, rollout {t1 - t0:.1f}s): "
            f"success={sum(rewards) / len(rewards):.3f} clean_call={sum(calls) / len(calls):.3f} "
            f"turns={rollout.metrics.turns / len(records):.2f} errors={sum(rollout.metrics.errors.values())} "
            f"generated_tokens={sum(len(r['old_logps']) for r in records)} trained_tokens={trained} "
            f"logp_gap={gap:.2e} loss={out['loss']:.4f} grad_norm={out['grad_norm']:.3f}"
        )
    sampler.path = model.save("sampler-last", is_sampler=True).twinkle_path
    after = evaluate(rollout, pool, HELD_OUT, MAX_TOKENS)
    saved = model.save("last-checkpoint").twinkle_path
    logger.info(f"adapter and optimizer state saved on the server: {saved}")
    logger.info(f"held-out greedy success: {base:.3f} before, {after:.3f} after")


def main() -> None:
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the child server
    with server() as url:
        init_twinkle_client(base_url=url, api_key=os.environ.get("TWINKLE_SERVER_TOKEN") or "EMPTY_TOKEN")
        client_sampler = vLLMSampler()
        client_sampler.set_template(args.template.template_cls or "Template")
        sampler = OnCheckpoint(client_sampler)
        rollout = ClientMultiTurnRollout(sampler, sampler.template, max_turns=MAX_TURNS, reward_fn=success)
        pool = EnvPool(BATCH * G, env_cls=ArithmeticEnv)
        try:
            train(rollout, sampler, pool)
        finally:
            pool.close()
    logger.info(f"wall time {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
