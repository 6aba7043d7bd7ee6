"""``twinkle server [flags]``: parse the flags, build the app, run it on uvicorn.

With ``--mode ray`` the server stops its groups' workers (and a local Ray instance it started)
when it ends, on Ctrl-C and on SIGTERM alike: uvicorn shuts down gracefully on either signal and
then raises it again, so SIGTERM is made to end the process with ``SystemExit``, which runs
that clean-up, instead of killing it outright."""

import signal
import sys
from typing import Any

from twinkle.server.config import ServerConfig, parse_args
from twinkle.utils.errors import UserError

SIGTERM_STATUS = 128 + signal.SIGTERM


def serve(argv: list[str]) -> int:
    config = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        raise UserError("twinkle server needs the server extra: pip install 'twinkle[server]'") from None
    from twinkle.server.app import create_app

    if config.mode != "ray":
        app = create_app(config)
        _announce(app, config)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
        return 0
    from twinkle.server.ray_groups import stop_groups

    try:
        app = create_app(config)
        _announce(app, config)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    finally:
        stop_groups()
    return 0


def _announce(app: Any, config: ServerConfig) -> None:
    where = ""
    if config.mode == "ray":
        sampler = f"sampler {config.sampler_ranks}" if config.sampler_ranks else "sampling on the model"
        where = f" (Ray device groups: model {config.model_ranks}, {sampler})"
    print(
        f"twinkle server: {app.state.server.base_model} on http://{config.host}:{config.port}{where}",
        flush=True,
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(SIGTERM_STATUS)
