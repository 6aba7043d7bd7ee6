"""``--mode ray``: the driver runs the same script, with the same arguments, on fsdp x dp workers.

``initialize(mode="ray")`` in the driver calls ``run_job`` and never returns to the script: it
connects to a cluster (``--ray-address`` / ``$RAY_ADDRESS``, else a local one started for the
job and stopped at its end), reserves one bundle per rank in a placement group (a GPU each where
the cluster has GPUs, else a CPU), starts one actor per rank and runs the script in it with
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...). The workers then take the
local path: they form the torch process group themselves (nccl or gloo), and checkpoints,
metrics and resume are the same as under torchrun.

Plain actors rather than Ray Train's ``TorchTrainer``: a worker reaches the script's first line
several times sooner, a death is seen in milliseconds, exit codes arrive as they are,
and the restart rule is ours (``TorchTrainer`` retried some deaths and not others). The cost is
choosing ``MASTER_ADDR`` and the port here.

When a worker dies (SIGKILL, out of memory, a lost node) every worker is stopped; with
``--max-restarts K`` the group is started again up to K times, resuming from the newest complete
checkpoint this job wrote under ``--output-dir``. The job's exit code is the first failing
rank's (``PREEMPTED_EXIT_CODE`` after a SIGTERM, which the driver passes on to every worker)."""

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.distributed.mesh import DeviceMesh
from twinkle.runtime.preemption import PREEMPTED_EXIT_CODE
from twinkle.runtime.ray_cluster import (
    connect,
    free_port_here,
    import_ray,
    local_ranks,
    passed_environment,
    place,
)
from twinkle.runtime.ray_logs import DRAIN_SECONDS, Drain, end_streams
from twinkle.runtime.ray_logs import ENV as LOG_END_ENV
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

# How long the other ranks may take to report after one rank's script failed (see ``wait``)
DEATH_GRACE_SECONDS = 10
FAILED_DRAIN_SECONDS = 2.0  # the surviving ranks' tracebacks, after a rank died and wrote no end line
CHECKPOINT_PREFIXES = ("checkpoint-", "last-checkpoint")


@dataclass(frozen=True)
class Outcome:
    rank: int
    code: int
    cause: str  # empty for a clean exit


_ray = import_ray  # the connection and placement are shared with the single controller (ray_cluster)
_connect = connect
_local_ranks = local_ranks


def _bundles(ray: Any, world: int) -> tuple[list[dict[str, float]], str]:
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus:
        return [{"GPU": 1, "CPU": 1}] * world, "GPU"
    return [{"CPU": 1}] * world, "CPU"


def _reserve(ray: Any, world: int, placement: str) -> Any:
    bundles, kind = _bundles(ray, world)
    have = ray.cluster_resources()
    if have.get(kind, 0) < world:
        raise UserError(
            f"--mode ray: {world} workers need {world} {kind}(s), and the cluster has "
            f"{have.get(kind, 0):g} ({', '.join(f'{k} {v:g}' for k, v in sorted(have.items()) if k in ('CPU', 'GPU'))}); "
            "lower --fsdp-size/--dp-size or add nodes"
        )
    return place(ray, bundles, placement, f"--mode ray: {world} workers of {bundles[0]} ({placement})")


class Rank:
    """One worker: runs the script as ``__main__`` in its own process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:  # what Ray puts before each of the worker's log lines
        return f"rank{self.rank}"

    def where(self) -> tuple[str, int, int, str]:
        """This worker's node address, a free port on it, its process id and its node's id."""
        import ray

        address, port = free_port_here()
        return address, port, os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, script: str, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        from twinkle.utils import logger

        os.environ.update(env)
        logger.reset()  # this process is a rank only from here: the rank's prefix and level
        sys.argv = [script, *argv]
        sys.path.insert(0, str(Path(script).resolve().parent))
        try:
            return self._run(script)
        finally:
            if os.environ.get(LOG_END_ENV):
                end_streams(self.rank)

    @staticmethod
    def _run(script: str) -> tuple[int, str]:
        import runpy
        import traceback

        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            return code, "" if code == 0 else f"exited with code {code}"
        except UserError as exc:
            message = " ".join(str(exc).split())
            print(f"error: {message}", file=sys.stderr, flush=True)
            return 2, message
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which ends the job
            traceback.print_exc()
            return 1, f"{type(exc).__name__}: {exc}"
        return 0, ""


def _worker_env(rank: int, world: int, local: tuple[int, int], master: tuple[str, int]) -> dict[str, str]:
    env = passed_environment()
    env.update(
        TWINKLE_RAY_WORKER="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local[0]),
        LOCAL_WORLD_SIZE=str(local[1]),
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
    )
    return env


class Attempt:
    """One launch of the group: its actors and their running scripts."""

    def __init__(self, ray: Any, group: Any, world: int, argv: list[str], log_end: bool = False) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        bundle = _bundles(ray, world)[0][0]
        # the whole bundle: Ray then sets OMP_NUM_THREADS to its CPU count, 1, as torchrun does
        actor = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0)(Rank)
        self.actors = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            ).remote(i)
            for i in range(world)
        ]
        places = ray.get([a.where.remote() for a in self.actors])
        self.pids = [place[2] for place in places]
        self.nodes = len({place[3] for place in places})
        master = (places[0][0], places[0][1])
        locals_ = _local_ranks([place[3] for place in places])
        script = str(Path(sys.argv[0]).resolve())
        extra = {LOG_END_ENV: "1"} if log_end else {}
        self.runs = {
            a.run.remote(script, argv, {**_worker_env(i, world, locals_[i], master), **extra}): i
            for i, a in enumerate(self.actors)
        }

    def wait(self) -> Outcome | None:
        """The failing rank's outcome, or None when every rank exited cleanly. A worker that died
        is the cause over a rank that failed: when one rank's script fails, the others get up to
        ``DEATH_GRACE_SECONDS`` to report, because a killed worker's peers see their collective
        cut off (a gloo read error) before Ray reports the death itself."""
        pending = list(self.runs)
        failed: Outcome | None = None
        while pending:
            timeout = None if failed is None else DEATH_GRACE_SECONDS
            done, pending = self.ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break
            rank = self.runs[done[0]]
            try:
                code, cause = self.ray.get(done[0])
            except self.ray.exceptions.RayActorError as exc:
                first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
                return Outcome(rank, 1, f"the worker process died ({first})")
            if code != 0 and failed is None:
                failed = Outcome(rank, code, cause)
        return failed

    def terminate(self) -> None:
        """SIGTERM to every worker: they save at the next step boundary and exit."""
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:  # on another node, or gone: its actor's end is seen anyway
                pass

    def stop(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)


def _resumable_since(output_dir: str, started: float) -> bool:
    """Whether this job wrote a checkpoint under ``output_dir`` (a restart resumes only from its own)."""
    folder = Path(output_dir).expanduser()
    if not folder.is_dir():
        return False
    return any(
        p.is_dir() and p.name.startswith(CHECKPOINT_PREFIXES) and p.stat().st_mtime >= started
        for p in folder.iterdir()
    )


def _restart_argv(argv: list[str]) -> list[str]:
    """``argv`` resuming from the newest complete checkpoint (``auto``) instead of where it started."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume-from-checkpoint":
            skip = True
            continue
        if not arg.startswith("--resume-from-checkpoint="):
            out.append(arg)
    return [*out, "--resume-from-checkpoint", "auto"]


def run_job(mesh: DeviceMesh, defaults: Any) -> int:
    """Run ``sys.argv`` on ``mesh.world_size`` Ray workers; the job's exit code."""
    ray = _ray()
    logger = get_logger()
    started = time.time()
    local = _connect(ray, defaults.ray_address)
    drain = Drain.install()  # the ranks' last lines are printed before the job ends
    attempt = None
    previous = signal.getsignal(signal.SIGTERM)
    terminated = {"yes": False}

    def on_sigterm(signum: int, frame: object) -> None:
        terminated["yes"] = True
        if attempt is not None:
            attempt.terminate()

    try:
        group = _reserve(ray, mesh.world_size, defaults.ray_placement)
        signal.signal(signal.SIGTERM, on_sigterm)
        argv = list(sys.argv[1:])
        for restart in range(defaults.max_restarts + 1):
            if drain is not None:
                drain.reset()
            attempt = Attempt(ray, group, mesh.world_size, argv, log_end=drain is not None)
            logger.info(f"ray: {mesh.world_size} workers on {attempt.nodes} node(s) ({mesh.describe()})")
            outcome = attempt.wait()
            if drain is not None:  # a dead rank writes no end: a failed group gets a short wait
                drain.wait(
                    mesh.world_size, timeout=DRAIN_SECONDS if outcome is None else FAILED_DRAIN_SECONDS
                )
            attempt.stop()
            if outcome is None:
                return 0
            if terminated["yes"] or outcome.code in (2, PREEMPTED_EXIT_CODE):
                return outcome.code  # preempted, or a usage error: a restart would not help
            left = defaults.max_restarts - restart
            if left == 0:
                raise UserError(f"--mode ray: rank {outcome.rank} {outcome.cause}; the job stops")
            logger.warning(
                f"ray: rank {outcome.rank} {outcome.cause}; restarting the workers ({left} restart(s) left)"
            )
            if _resumable_since(defaults.output_dir, started):
                argv = _restart_argv(argv)
        return 1
    except KeyboardInterrupt:
        logger.warning("ray: interrupted; stopping the workers")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if attempt is not None:
            attempt.stop()
        if drain is not None:
            drain.remove()
        ray.shutdown()
        if local:
            logger.info("ray: the local cluster is stopped")
