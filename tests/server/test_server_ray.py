"""``twinkle server --mode ray``: the model on a device group of 2 CPU ranks (FSDP2, gloo), the
sampler on a group of 2 ranks, each with its own copy of the base model, on a local Ray cluster
of this module's own (``ray start --head``, 5 logical CPUs); the server itself runs as the command
does, in a process of its own, and is driven by the official Tinker SDK.

- A supervised loop gives the losses, gradient norms, per-datum log-probs and adapter of the same
  loop on a local-mode server (1e-5): steps of 3, 1 and 2 datums and a forward of 1, so the ranks
  get uneven shares and one rank none at all, and Tinker's summed gradient must come out of
  FSDP2's averaged one.
- Sampling runs on the sampler group (each rank its share of the completions) from the
  checkpoint's LoRA weights: the sampled tokens' log-probs equal ``compute_logprobs`` of the model
  group (1e-4), before and after another step and save, again for the older checkpoint once the
  newer one was sampled, and for the base model. With ``--sampler-ranks 0`` (and one model rank)
  the model's rank samples itself.
- Bad flag combinations are one ``error:`` line, before anything loads (the flag checks run in
  the default suite; groups that do not fit the cluster need the cluster).

The server stops on SIGTERM through ``SystemExit`` (status 143), which stops its workers.
"""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from ports import free_port
from safetensors.torch import load_file
from serving import KEY_A, KEY_B
from test_server import LR, ROWS, datum
from tinker import types

from twinkle.cli.main import main

TWINKLE = str(Path(sys.executable).with_name("twinkle"))
RAY = str(Path(sys.executable).with_name("ray"))
CLUSTER_RUN = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]


def cluster_run(test):
    """Marks a test that needs Ray and starts a cluster (``pytest -m cluster``)."""
    for mark in CLUSTER_RUN:
        test = mark(test)
    return test


SCHEDULE = [ROWS["a"] + ROWS["b"], ROWS["b"], ROWS["a"]]  # 3, 1 and 2 datums over 2 ranks
PROMPT = [5, 6, 7]


# ------------------------------------------------------------------ default run: the flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model-ranks", "2"], "error: --model-ranks needs --mode ray"),
        (
            ["--sampler-ranks", "0", "--ray-address", "auto"],
            "error: --sampler-ranks, --ray-address need --mode ray",
        ),
        (["--mode", "slurm"], "error: --mode must be local or ray, got 'slurm'"),
        (["--mode", "ray", "--model-ranks", "0"], "error: --model-ranks must be at least 1, got 0"),
        (["--mode", "ray", "--sampler-ranks", "-1"], "error: --sampler-ranks must be 0"),
    ],
)
def test_a_bad_flag_combination_is_one_error_line(flags, message, monkeypatch, capsys):
    monkeypatch.setenv("TWINKLE_API_KEYS", KEY_A)
    assert main(["server", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(message), err


# ------------------------------------------------------------------ cluster runs


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TWINKLE_", "RAY_ADDRESS"))}
    return {
        **env,
        "TWINKLE_CACHE": str(tmp_path / "cache"),
        "TWINKLE_API_KEYS": f"{KEY_A},{KEY_B}",
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
        "TINKER_TELEMETRY": "0",
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of this module's own: 5 logical CPUs (2 model ranks and 2 sampler ranks, then 1
    model rank sampling itself)."""
    temp = Path("/tmp") / f"tws-{os.getpid()}"
    port = free_port()
    env = _env(tmp_path_factory.mktemp("cluster"))
    subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=5", "--include-dashboard=false",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        check=True, capture_output=True, timeout=120, env=env,
    )  # fmt: skip
    yield f"127.0.0.1:{port}"
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)
    shutil.rmtree(temp, ignore_errors=True)


def _serve(tiny_model_dir: Path, tmp_path: Path, address: str, *flags: str) -> subprocess.Popen:
    command = [
        TWINKLE, "server", "--mode", "ray", "--ray-address", address, "--model-id", str(tiny_model_dir),
        "--max-r", "8", "--output-dir", str(tmp_path / "out"), *flags,
    ]  # fmt: skip
    with open(tmp_path / "server.log", "w") as log:  # the process keeps its own handle on it
        return subprocess.Popen(
            command, cwd=tmp_path, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT
        )


def _started(proc: subprocess.Popen, tmp_path: Path, port: int) -> str:
    """The server's URL once it answers (the process is alive and its groups are up)."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
        assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-6000:]
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.5)


def _stop(proc: subprocess.Popen, tmp_path: Path) -> None:
    """SIGTERM ends the server through ``SystemExit`` (status 143), which stops its workers; a
    process killed outright by the signal would report -15."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, (tmp_path / "server.log").read_text()[-6000:]


@pytest.fixture(scope="module")
def ray_server(cluster, tiny_model_dir, tmp_path_factory):
    """``twinkle server --mode ray --model-ranks 2 --sampler-ranks 2`` on the module's cluster."""
    tmp_path = tmp_path_factory.mktemp("ray-server")
    port = free_port()
    proc = _serve(
        tiny_model_dir, tmp_path, cluster, "--model-ranks", "2", "--sampler-ranks", "2", "--port", str(port)
    )
    try:
        yield _started(proc, tmp_path, port), tmp_path / "out"
    finally:
        _stop(proc, tmp_path)


def _train(url: str, key: str, base: str) -> tuple[list[float], list[float], list, str]:
    """The schedule's cross-entropy steps through the SDK, a ``forward`` of one datum, then
    ``save_state``: (loss:sum and gradient norm of each step, each pass's per-datum log-probs,
    the saved checkpoint's path)."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    tc = client.create_lora_training_client(base_model=base, rank=4, train_unembed=False).result()
    losses, norms, logprobs = [], [], []
    for rows in SCHEDULE:
        out = tc.forward_backward([datum(*r) for r in rows], "cross_entropy").result()
        norms.append(tc.optim_step(types.AdamParams(learning_rate=LR)).result().metrics["grad_norm"])
        losses.append(out.metrics["loss:sum"])
        logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
    out = tc.forward([datum(*ROWS["b"][0])], "cross_entropy").result()  # one datum: a rank idles
    logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
    return losses, norms, logprobs, tc.save_state("final").result().path


def _saved(out_dir: Path, path: str) -> dict:
    """The adapter weights of checkpoint ``tinker://<run>/weights/<name>`` under ``out_dir``."""
    run, kind, name = path[len("tinker://") :].split("/")
    (found,) = out_dir.glob(f"*/{run}/{kind}/{name}/adapter_model.safetensors")
    return load_file(found)


@cluster_run
def test_an_sdk_loop_trains_as_on_a_local_server(ray_server, server, tiny_model_dir):
    """Key B's first run on each server (the same LoRA initialisation): same losses, gradient
    norms (Adam alone would hide a gradient off by a constant factor), per-datum log-probs in
    order, and saved adapter."""
    url, out_dir = ray_server
    base = str(tiny_model_dir)
    losses, norms, logprobs, path = _train(url, KEY_B, base)
    expected_losses, expected_norms, expected_logprobs, expected_path = _train(server.url, KEY_B, base)
    np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose(norms, expected_norms, atol=0, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trained
    for step, expected in zip(logprobs, expected_logprobs, strict=True):
        assert len(step) == len(expected)
        for got, want in zip(step, expected, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    state = _saved(out_dir, path)
    expected_state = _saved(server.app.state.server.config.output_dir, expected_path)
    assert state.keys() == expected_state.keys()
    for k, v in expected_state.items():
        np.testing.assert_allclose(state[k].numpy(), v.numpy(), atol=1e-5, rtol=0, err_msg=k)


def _sampled_as_scored(sampler, seed: int) -> list[list[int]]:
    """Two completions of ``PROMPT`` (the sampler group); each one's log-probs equal the model
    group's ``compute_logprobs`` of it (1e-4). Returns the completions' tokens."""
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 6
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + list(seq.tokens))).result()
        np.testing.assert_allclose(scored[len(PROMPT) :], seq.logprobs, atol=1e-4, rtol=0)
    return [list(seq.tokens) for seq in out.sequences]


def _scores(sampler, tokens: list[int]) -> np.ndarray:
    """The model group's log-probs of ``tokens`` after ``PROMPT`` under the sampler's weights."""
    return np.array(
        sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + tokens)).result()[len(PROMPT) :]
    )


@cluster_run
def test_the_sampler_group_samples_each_saved_checkpoint(ray_server, tiny_model_dir):
    """The sampler group samples the checkpoint the sampling client names: after a step and a new
    save, the new one (its log-probs are the new weights', not the old); then the old one again.
    The base model samples there too."""
    url, _ = ray_server
    client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
    tc = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    data = [datum(*r) for r in ROWS["a"]]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    first = tc.save_weights_and_get_sampling_client().result()
    _sampled_as_scored(first, seed=3)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=10 * LR)).result()
    second = tc.save_weights_and_get_sampling_client().result()
    tokens = _sampled_as_scored(second, seed=3)
    assert all(np.abs(_scores(second, t) - _scores(first, t)).max() > 1e-2 for t in tokens)  # new weights
    _sampled_as_scored(first, seed=4)  # the older checkpoint is sent to the sampler again
    _sampled_as_scored(client.create_sampling_client(base_model=str(tiny_model_dir)).result(), seed=5)


@cluster_run
def test_one_model_rank_samples_itself_with_sampler_ranks_0(cluster, tiny_model_dir, tmp_path):
    """``--model-ranks 1 --sampler-ranks 0``: no sampler group; the model's rank trains and
    samples the saved checkpoint in a slot of its own, as a local server does."""
    port = free_port()
    proc = _serve(
        tiny_model_dir, tmp_path, cluster, "--model-ranks", "1", "--sampler-ranks", "0", "--port", str(port)
    )
    try:
        client = tinker.ServiceClient(base_url=_started(proc, tmp_path, port), api_key=KEY_A)
        tc = client.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=4, train_unembed=False
        ).result()
        tc.forward_backward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        _sampled_as_scored(tc.save_weights_and_get_sampling_client().result(), seed=3)
    finally:
        _stop(proc, tmp_path)
    assert "group 'sampler'" not in (tmp_path / "server.log").read_text()


@cluster_run
def test_groups_that_do_not_fit_the_cluster_are_one_line(cluster, tiny_model_dir, tmp_path):
    """6 ranks on a cluster of 5 CPUs: refused before any worker starts."""
    proc = _serve(tiny_model_dir, tmp_path, cluster, "--model-ranks", "5", "--port", str(free_port()))
    assert proc.wait(120) == 2
    lines = (tmp_path / "server.log").read_text().strip().splitlines()
    assert lines[-1].startswith("error: initialize(groups=...): the groups ask for 6 CPU(s)"), lines
    assert not any("Traceback" in line for line in lines)
