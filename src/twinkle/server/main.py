"""``twinkle server [flags]``: parse the flags, build the app, run it on uvicorn."""

from twinkle.server.config import parse_args
from twinkle.utils.errors import UserError


def serve(argv: list[str]) -> int:
    config = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        raise UserError("twinkle server needs the server extra: pip install 'twinkle[server]'") from None
    from twinkle.server.app import create_app

    app = create_app(config)
    print(f"twinkle server: {app.state.server.base_model} on http://{config.host}:{config.port}", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    return 0
