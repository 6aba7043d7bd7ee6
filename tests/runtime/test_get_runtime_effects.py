"""``get_runtime()`` before ``initialize()`` changes nothing in the process (ARCHITECTURE section 2:
``initialize()`` applies every process-wide effect, in one place).

Each case runs in a fresh interpreter: it records the process-wide state a run's set-up touches
(the seeds and states of torch's, Python's and numpy's generators, every signal handler, the
environment, ``sys.excepthook``, the process group, the SIGTERM handler's state, the module's
runtime), then takes the paths a component takes when the user never calls ``initialize``
(``get_runtime``, ``run_defaults``, ``get_device_placement``, the DataLoader's rank lookup), and
records it again. ``import twinkle`` is held to the same rule."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, pickle, random, signal, sys

    import numpy as np
    import torch


    def state():
        handlers = {}
        for sig in signal.valid_signals():
            try:
                handlers[int(sig)] = repr(signal.getsignal(sig))
            except (OSError, ValueError):
                pass
        return {
            "torch_seed": torch.initial_seed(),
            "torch_rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "random": hashlib.sha256(pickle.dumps(random.getstate())).hexdigest(),
            "numpy": hashlib.sha256(pickle.dumps(np.random.get_state())).hexdigest(),
            "signals": handlers,
            "env": dict(os.environ),
            "excepthook": repr(sys.excepthook),
            "process_group": torch.distributed.is_initialized(),
        }


    first = state()
    import twinkle
    from twinkle.dataloader.options import data_rank
    from twinkle.runtime import get_runtime, preemption, run_defaults
    from twinkle.runtime import runtime as runtime_module

    before = state()
    rt = get_runtime()
    run_defaults()
    placement = twinkle.get_device_placement()
    world, rank = data_rank(None, None, None)
    after = state()
    print(json.dumps({
        "changed": sorted(k for k in before if before[k] != after[k]),
        "import_changed": sorted(k for k in first if first[k] != before[k]),
        "kept": runtime_module._RUNTIME is not None,
        "handler_installed": preemption._state["installed"],
        "runtime": [rt.mode, rt.world_size, rt.rank, rt.local_rank, rt.device.type, rt.seed],
        "data": [world, rank],
        "placement": placement,
    }))
    """
)


def _run(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**base, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("env", "world", "rank"),
    [
        ({}, 1, 0),  # a plain script or a notebook
        # a rank of a torchrun job whose script never calls initialize: no process group is formed
        (
            {
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1",
            },
            2,
            1,
        ),
    ],
)
def test_get_runtime_before_initialize_changes_nothing(env, world, rank):
    from twinkle.runtime import RunDefaults

    out = _run(env)
    assert out["import_changed"] == [], f"import twinkle changed {out['import_changed']}"
    assert out["changed"] == [], f"get_runtime() before initialize() changed {out['changed']}"
    assert not out["kept"] and not out["handler_installed"]
    mode, world_size, rank_, local_rank, _, seed = out["runtime"]
    assert (mode, world_size, rank_, local_rank, seed) == ("local", world, rank, rank, RunDefaults().seed)
    assert out["data"] == [world, rank]
    assert f"world_size={world}" in out["placement"]
