"""Launch training scripts in one process or under torchrun, with a free port and a hard timeout."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm
from ports import free_port


@dataclass
class Job:
    returncode: int
    output: str  # stdout and stderr, interleaved
    wall_s: float


class Launcher:
    """Runs ``script args`` as ``nproc`` processes: one (forked from a warm process, ``warm``) for
    1, torchrun otherwise.

    Every job gets one thread per process (the tests share two cores, and the 1-process and
    N-process runs then reduce in comparable orders), the test's cache folder, and no other
    ``TWINKLE_`` variable from the caller's environment (those would feed the CLI)."""

    def __init__(self, cache_dir: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
        env.update(TWINKLE_CACHE=str(cache_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.env = env

    def torchrun(self, script: Path, args: list[str], nproc: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(script), *args,
        ]  # fmt: skip

    def run(self, script: Path, args: list[str], nproc: int = 1, timeout_s: float = 120) -> Job:
        """Run to completion; on timeout kill the whole process group and fail the test."""
        start = time.perf_counter()
        if nproc == 1:
            try:
                done = warm.run([str(script), *args], script.parent, self.env, timeout_s, merge=True)
            except subprocess.TimeoutExpired as exc:
                pytest.fail(f"{script.name} x1 ran past {timeout_s} s:\n{exc.output[-4000:]}")
            return Job(done.returncode, done.stdout, time.perf_counter() - start)
        proc = subprocess.Popen(
            self.torchrun(script, args, nproc),
            cwd=script.parent,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, so a timeout can end every worker
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            pytest.fail(f"{script.name} x{nproc} ran past {timeout_s} s:\n{output[-4000:]}")
        return Job(proc.returncode, output, time.perf_counter() - start)


@pytest.fixture(scope="session")
def launcher(tmp_path_factory) -> Launcher:
    return Launcher(tmp_path_factory.getbasetemp() / "twinkle-cache")


@pytest.fixture(scope="session")
def baseline(tiny_model_dir, tmp_path_factory, launcher):
    """The contract in one process and on 2 FSDP2 ranks, shared by the comparisons of
    ``test_contract_torchrun.py`` and ``test_ray_mode.py``."""
    from test_contract_torchrun import SCRIPT, contract_args

    tmp_path = tmp_path_factory.mktemp("contract")
    single = launcher.run(SCRIPT, contract_args(tiny_model_dir, tmp_path / "one"), nproc=1)
    assert single.returncode == 0, single.output[-6000:]
    sharded = launcher.run(
        SCRIPT, [*contract_args(tiny_model_dir, tmp_path / "two"), "--fsdp-size", "2"], nproc=2
    )
    assert sharded.returncode == 0, sharded.output[-6000:]
    return single, sharded, tmp_path
