"""``EnvPool``: N environments, one slot per trajectory, in this process or on Ray workers;
``EnvPoolAdapter``: one slot seen as an ``Env``.

With ``num_workers=0`` the environments live in this process. With ``num_workers=W`` they are
split over W Ray actors (contiguous slots each), so slow environments run beside the trainer
instead of inside its process; calls from several threads (the rollout steps its trajectories
concurrently) run on the W workers at once. The pool, not the worker, draws each episode's seed
from ``(seed, slot, episode)``: the same pool seed gives the same episodes in-process and on any
number of workers."""

import importlib
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.envs.base import StepResult


def resolve_env_class(env_cls: Any) -> Any:
    """A class, or ``'module:Class'`` / ``'module.Class'`` imported."""
    if not isinstance(env_cls, str):
        return env_cls
    module, _, name = env_cls.rpartition(":") if ":" in env_cls else env_cls.rpartition(".")
    if not module:
        raise UserError(f"env_cls={env_cls!r}: write it as 'module:Class' or 'module.Class'")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        raise UserError(f"env_cls={env_cls!r}: cannot import {module!r} ({exc})") from exc
    if found is None:
        raise UserError(f"env_cls={env_cls!r}: {module!r} has no {name!r}")
    return found


class _Shard:
    """The environments of slots ``start .. start + count - 1`` (in-process, or a Ray actor)."""

    def __init__(self, env_cls: Any, env_kwargs: dict[str, Any], start: int, count: int):
        cls = resolve_env_class(env_cls)
        self.start = start
        self.envs = [cls(**env_kwargs) for _ in range(count)]

    def reset(self, idx: int, seed: int | None) -> StepResult:
        return self.envs[idx - self.start].reset(seed=seed)

    def step(self, idx: int, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        return self.envs[idx - self.start].step(tool_name, arguments)

    def tools(self) -> list[dict[str, Any]]:
        return self.envs[0].tools() if self.envs and hasattr(self.envs[0], "tools") else []

    def close(self) -> None:
        for env in self.envs:
            env.close()


class EnvPool:
    """``pool_size`` environments ``env_cls(**env_kwargs)`` (default: upstream's ``OpenEnv``
    with ``env_kwargs``), reset and stepped by slot. ``num_workers``: 0 in-process, else that many
    Ray actors (``twinkle[ray]``; joins ``$RAY_ADDRESS`` or starts a local cluster). ``seed``:
    episodes drawn from it per slot (None: each environment's own randomness)."""

    def __init__(
        self,
        pool_size: int = 32,
        env_kwargs: dict[str, Any] | None = None,
        env_cls: Any = None,
        num_workers: int = 0,
        seed: int | None = None,
    ):
        if pool_size < 1:
            raise UserError(f"EnvPool(pool_size={pool_size}): a pool needs at least one slot")
        if num_workers < 0:
            raise UserError(f"EnvPool(num_workers={num_workers}): 0 (in-process) or more Ray workers")
        if env_cls is None:
            env_cls = "twinkle_agentic.envs.openenv:OpenEnv"
        self._pool_size, self.seed = pool_size, seed
        self._episodes = [0] * pool_size
        kwargs = dict(env_kwargs or {})
        workers = min(num_workers, pool_size)
        self.num_workers = workers
        if workers == 0:
            self._shards: list[Any] = [_Shard(env_cls, kwargs, 0, pool_size)]
            self._bounds = [(0, pool_size)]
            self._remote = False
            return
        ray = _ray()
        actor = ray.remote(num_cpus=0)(_Shard)  # environments mostly wait: reserve no core for them
        size = -(-pool_size // workers)
        self._bounds = [(s, min(s + size, pool_size)) for s in range(0, pool_size, size)]
        self._shards = [actor.remote(env_cls, kwargs, s, e - s) for s, e in self._bounds]
        self._remote = True
        self._get(self._shards[0].tools.remote())  # a worker that cannot build its envs fails here

    @property
    def pool_size(self) -> int:
        return self._pool_size

    def _owner(self, idx: int) -> Any:
        if not 0 <= idx < self._pool_size:
            raise UserError(f"EnvPool: slot {idx} is outside the pool's {self._pool_size} slots")
        for shard, (start, end) in zip(self._shards, self._bounds, strict=True):
            if start <= idx < end:
                return shard
        raise AssertionError(idx)

    def _call(self, shard: Any, method: str, *args: Any) -> Any:
        if not self._remote:
            return getattr(shard, method)(*args)
        return self._get(getattr(shard, method).remote(*args))

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref)

    def episode_seed(self, idx: int) -> int | None:
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + idx * 7_919 + self._episodes[idx] * 104_729) % 2**31

    def reset(self, idx: int, seed: int | None = None) -> StepResult:
        """Start a new episode in slot ``idx`` (``seed``: this one; else the pool's draw)."""
        shard = self._owner(idx)
        seed = self.episode_seed(idx) if seed is None else seed
        self._episodes[idx] += 1
        return self._call(shard, "reset", idx, seed)

    def step(self, idx: int, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        return self._call(self._owner(idx), "step", idx, tool_name, dict(arguments or {}))

    def reset_batch(self, indices: list[int]) -> list[StepResult]:
        """Reset several slots, the workers in parallel; results in the order of ``indices``."""
        if not self._remote:
            return [self.reset(i) for i in indices]
        refs = []
        for i in indices:
            shard, seed = self._owner(i), self.episode_seed(i)
            self._episodes[i] += 1
            refs.append(shard.reset.remote(i, seed))
        return self._get(refs)

    def step_batch(
        self, indices: list[int], tool_names: list[str], arguments_list: list[dict[str, Any]]
    ) -> list[StepResult]:
        """Step several slots, the workers in parallel; results in the order of ``indices``."""
        if not self._remote:
            return [self.step(i, n, a) for i, n, a in zip(indices, tool_names, arguments_list, strict=True)]
        refs = [
            self._owner(i).step.remote(i, n, dict(a or {}))
            for i, n, a in zip(indices, tool_names, arguments_list, strict=True)
        ]
        return self._get(refs)

    def tools(self) -> list[dict[str, Any]]:
        """The actions of the pool's environments, as tool descriptions."""
        return self._call(self._shards[0], "tools")

    def get_adapters(self, n: int) -> list["EnvPoolAdapter"]:
        """Slots ``0 .. n-1``, each as an ``Env`` (one per trajectory)."""
        if n > self._pool_size:
            raise UserError(
                f"EnvPool.get_adapters({n}): the pool has {self._pool_size} slots; make it larger"
            )
        return [EnvPoolAdapter(self, i) for i in range(n)]

    def close(self) -> None:
        for shard in self._shards:
            self._call(shard, "close")
        if self._remote:
            import ray

            for shard in self._shards:
                ray.kill(shard)
        self._shards = []


def _ray() -> Any:
    from twinkle.runtime.ray_cluster import connect, import_ray

    ray = import_ray()
    if not ray.is_initialized():
        connect(ray, None)
    return ray


class EnvPoolAdapter:
    """Slot ``idx`` of ``pool`` as an ``Env``: ``reset``/``step`` go to that slot."""

    def __init__(self, pool: EnvPool, idx: int):
        self._pool, self._idx = pool, idx
        self._episode_reward = 0.0

    @property
    def slot(self) -> int:
        return self._idx

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        self._episode_reward = 0.0
        return self._pool.reset(self._idx, seed)

    def step(self, tool_name: str, arguments: dict[str, Any] | None = None) -> StepResult:
        result = self._pool.step(self._idx, tool_name, arguments or {})
        self._episode_reward += float(result.reward or 0.0)
        return result

    def tools(self) -> list[dict[str, Any]]:
        return self._pool.tools()

    @property
    def episode_reward(self) -> float:
        return self._episode_reward

    def close(self) -> None:
        """The pool owns the environment; ``EnvPool.close`` closes it."""
