"""``twinkle server``'s command line and its API keys.

Keys come from ``--api-keys FILE`` (one key a line; ``#`` starts a comment; after the key,
optional limits ``max_adapters=N max_datums=N max_tokens=N rate=R``) or from the environment
variable ``TWINKLE_API_KEYS`` (keys separated by commas). The Tinker SDK only sends keys that
start with ``tml-``.

``--mode ray`` puts the model (``--model-ranks``) and a sampler (``--sampler-ranks``) on device
groups of a Ray cluster (``--ray-address``); see ``twinkle.server.ray_groups``."""

import argparse
import importlib.util
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from twinkle.metric.sinks import parse_report_to
from twinkle.server.state import Limits
from twinkle.utils.errors import UserError

ENV_KEYS = "TWINKLE_API_KEYS"
ENV_OPERATOR_KEYS = "TWINKLE_OPERATOR_KEYS"
RAY_FLAGS = ("model_ranks", "sampler_ranks", "ray_address")  # taken by --mode ray only


@dataclass
class ServerConfig:
    model_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_loras: int = 4
    max_r: int = 32
    output_dir: Path = Path("output/server")
    idle_timeout: float = 1800.0  # seconds without a request before a run is parked (0: never)
    keys: dict[str, Limits] = field(default_factory=dict)
    report_to: tuple[str, ...] = ()  # tensorboard, wandb, swanlab: besides metrics.jsonl (server.report)
    mode: str = "local"  # "ray": the model and the sampler on Ray device groups (ray_groups)
    model_ranks: int = 1  # ray: ranks of the model's group (FSDP2 over them)
    sampler_ranks: int = 1  # ray: ranks of the sampler's group; 0: sample on the model's group
    ray_address: str | None = None  # ray: the cluster to join; None: $RAY_ADDRESS, else a local one
    max_request_seconds: float = 600.0  # the most one sliced request (sampling) may run
    future_ttl: float = 3600.0  # seconds a finished request's result is kept if never retrieved
    max_queued: int = 256  # requests one key may have waiting or running
    operator_keys: tuple[str, ...] = ()  # keys that may read /metrics (none: /metrics is off)
    keyless: bool = False  # no keys: one local user, any token, loopback only (``keyless_config``)


LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOCAL_KEY = "tml-local"  # the one tenant of a server without keys


def keyless_keys(host: str, defaults: Limits) -> dict[str, Limits]:
    """The keys of a server started without any: one local user whatever token it sends, which
    is safe only when nothing but this machine can reach it."""
    if host not in LOOPBACK:
        raise UserError(
            f"--host {host} without API keys would serve anyone who reaches it; pass --api-keys FILE "
            f"(or set {ENV_KEYS}) or keep --host 127.0.0.1"
        )
    return {LOCAL_KEY: defaults}


def parse_keys(text: str, where: str, defaults: Limits) -> dict[str, Limits]:
    keys: dict[str, Limits] = {}
    names = {f.name: f.type for f in fields(Limits)}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        limits = Limits(**defaults.__dict__)
        for item in line[1:]:
            name, _, value = item.partition("=")
            if name not in names:
                raise UserError(f"{where}:{n}: unknown limit {name!r}; use {', '.join(names)}")
            try:
                setattr(limits, name, float(value) if name == "rate" else int(value))
            except ValueError:
                raise UserError(f"{where}:{n}: {name}={value!r} is not a number") from None
        if not line[0].startswith("tml-"):
            raise UserError(f"{where}:{n}: an API key must start with 'tml-' (the Tinker SDK sends no other)")
        keys[line[0]] = limits
    return keys


def load_keys(path: str | None, defaults: Limits) -> dict[str, Limits]:
    """The keys of ``path``, else of ``$TWINKLE_API_KEYS``; none at all is a server without keys
    (``keyless_keys``); a file without any is ``UserError``."""
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--api-keys {path}: cannot read it ({exc.strerror})") from None
        keys = parse_keys(text, path, defaults)
    else:
        keys = parse_keys(os.environ.get(ENV_KEYS, "").replace(",", "\n"), ENV_KEYS, defaults)
    if not keys and path:
        raise UserError(f"--api-keys {path}: no API key in it (one key a line)")
    return keys


def load_operator_keys(path: str | None) -> list[str]:
    """The operator keys of ``path`` (one a line, ``#`` comments), else of
    ``$TWINKLE_OPERATOR_KEYS``; none is fine (``/metrics`` is off)."""
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--operator-keys {path}: cannot read it ({exc.strerror})") from None
    else:
        text = os.environ.get(ENV_OPERATOR_KEYS, "").replace(",", "\n")
    keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    keys = [k for k in keys if k]
    short = [k for k in keys if len(k) < 16 or any(c.isspace() for c in k)]
    if short:
        raise UserError(
            f"{path or ENV_OPERATOR_KEYS}: an operator key must be at least 16 characters without spaces"
        )
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="twinkle server",
        description="Serve one base model to many tenants, each training its own LoRA adapters "
        "through the Tinker SDK (ServiceClient(base_url=..., api_key=...)).",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="upstream's server_config.yaml: host, port, model id, per-key adapter limit, rate, adapter "
        "timeout (twinkle.server.yaml_config); flags given as well win; an unsupported key is refused by name",
    )
    p.add_argument(
        "--model-id", default=None, help="base model (local folder or hub id); default: the bundled model"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="adapter slots on the model, all tenants together (default 4)",
    )
    p.add_argument(
        "--max-r", type=int, default=32, help="largest LoRA rank a tenant may ask for (default 32)"
    )
    p.add_argument(
        "--output-dir",
        default="output/server",
        help="where runs and checkpoints are kept, one folder per key hash (default output/server)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help=f"API keys, one a line, each optionally followed by limits such as max_adapters=2 rate=20; "
        f"default: ${ENV_KEYS} (comma-separated); none: one local user with any token, on 127.0.0.1 only",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=1800.0,
        help="seconds without a request after which a run is saved and its slot freed; its next "
        "request loads it back (default 1800, 0: never)",
    )
    p.add_argument(
        "--report-to",
        default="none",
        help="comma list of tensorboard, wandb, swanlab: each run's metrics also there; tensorboard "
        "and wandb in the run's folder (<output-dir>/<key hash>/<run>/tensorboard, .../wandb: one wandb "
        "run per training run), swanlab in one experiment for the server (<output-dir>/swanlab, "
        "each run's metrics under '<run id>/'); wandb and swanlab offline without an API key; "
        "default none (metrics.jsonl only)",
    )
    p.add_argument(
        "--mode",
        default="local",
        help="local: the model in this process (default); ray: the model and a sampler on device "
        "groups of a Ray cluster, this process serving HTTP",
    )
    p.add_argument(
        "--model-ranks",
        type=int,
        default=None,
        help="--mode ray: ranks (devices) of the model's group, FSDP2 over them; each runs its share "
        "of a request's datums (default 1)",
    )
    p.add_argument(
        "--sampler-ranks",
        type=int,
        default=None,
        help="--mode ray: ranks of the sampler's group, each with its own copy of the base model that "
        "the sampled checkpoint's LoRA weights are sent to; 0: sample on the model's group (default 1)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="--mode ray: the Ray cluster to join (host:port, auto, ray://...); default $RAY_ADDRESS, "
        "else a local Ray instance started for the server",
    )
    p.add_argument(
        "--max-request-seconds",
        type=float,
        default=600.0,
        help="the most seconds one sampling request may run on the model (it runs in slices between "
        "other requests); past it the request fails (default 600, 0: no limit)",
    )
    p.add_argument(
        "--future-ttl",
        type=float,
        default=3600.0,
        help="seconds a finished request's result is kept when it is never retrieved; a retrieved one "
        "is kept 60 s after its first retrieval (default 3600)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests one key may have waiting or running; more answer 429 with retry-after (default 256)",
    )
    p.add_argument(
        "--operator-keys",
        default=None,
        metavar="FILE",
        help=f"keys that may read GET /metrics (Prometheus text; Authorization: Bearer KEY), one a line; "
        f"default ${ENV_OPERATOR_KEYS} (comma-separated); without any, /metrics is off",
    )
    p.add_argument(
        "--max-adapters", type=int, default=4, help="default live training runs per key (default 4)"
    )
    p.add_argument(
        "--max-datums", type=int, default=512, help="default datums per forward_backward (default 512)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=65536, help="default tokens per forward_backward (default 65536)"
    )
    p.add_argument(
        "--rate", type=float, default=50.0, help="default requests per second per key (default 50)"
    )
    return p


def parse_args(argv: list[str]) -> ServerConfig:
    args = build_parser().parse_args(argv)
    if args.config:
        from twinkle.server.yaml_config import read_config

        flags, inert = read_config(args.config)
        if inert:
            print(f"twinkle server: --config keys with no effect here: {', '.join(inert)}", flush=True)
        args = build_parser().parse_args(flags + list(argv))  # the command line's flags come last and win
    for name in ("port", "max_loras", "max_r", "max_adapters", "max_datums", "max_tokens", "max_queued"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.idle_timeout < 0:
        raise UserError(f"--idle-timeout must be 0 (never) or positive, got {args.idle_timeout}")
    if args.rate <= 0:
        raise UserError(f"--rate must be positive, got {args.rate}")
    if args.max_request_seconds < 0:
        raise UserError(
            f"--max-request-seconds must be 0 (no limit) or positive, got {args.max_request_seconds}"
        )
    if args.future_ttl <= 0:
        raise UserError(f"--future-ttl must be positive, got {args.future_ttl}")
    defaults = Limits(args.max_adapters, args.max_datums, args.max_tokens, args.rate)
    keys = load_keys(args.api_keys, defaults)
    keyless = not keys
    if keyless:
        keys = keyless_keys(args.host, defaults)
    operators = load_operator_keys(args.operator_keys)
    both = sorted(set(keys) & set(operators))
    if both:
        raise UserError(
            f"key {both[0][:8]}... is both a tenant's and an operator's; give the operator its own key"
        )
    ray = _ray_flags(args)
    return ServerConfig(
        model_id=args.model_id,
        host=args.host,
        port=args.port,
        max_loras=args.max_loras,
        max_r=args.max_r,
        output_dir=Path(args.output_dir),
        idle_timeout=args.idle_timeout,
        keys=keys,
        report_to=parse_report_to(args.report_to),
        max_request_seconds=args.max_request_seconds,
        future_ttl=args.future_ttl,
        max_queued=args.max_queued,
        operator_keys=tuple(operators),
        keyless=keyless,
        **ray,
    )


def _ray_flags(args: argparse.Namespace) -> dict:
    """``--mode`` and the flags only ``--mode ray`` takes, checked before anything loads."""
    given = [f"--{k.replace('_', '-')}" for k in RAY_FLAGS if getattr(args, k) is not None]
    if args.mode not in ("local", "ray"):
        raise UserError(f"--mode must be local or ray, got {args.mode!r}")
    if args.mode == "local":
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise UserError(
                f"{', '.join(given)} {verb} --mode ray (the model runs in this process otherwise)"
            )
        return {}
    model_ranks = 1 if args.model_ranks is None else args.model_ranks
    sampler_ranks = 1 if args.sampler_ranks is None else args.sampler_ranks
    if model_ranks < 1:
        raise UserError(f"--model-ranks must be at least 1, got {model_ranks}")
    if sampler_ranks < 0:
        raise UserError(
            f"--sampler-ranks must be 0 (sample on the model's group) or more, got {sampler_ranks}"
        )
    if importlib.util.find_spec("ray") is None:
        raise UserError("--mode ray needs Ray: pip install 'twinkle[ray]'")
    return {
        "mode": "ray",
        "model_ranks": model_ranks,
        "sampler_ranks": sampler_ranks,
        "ray_address": args.ray_address,
    }
