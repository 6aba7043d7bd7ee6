"""Run a ``twinkle server`` on a free local port in a thread of the test process."""

import socket
import threading
import time

KEY_A, KEY_B = "tml-tenant-a", "tml-tenant-b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, app, port: int):
        import uvicorn

        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "the server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.app.state.server.queue.stop()


def start(
    tiny_model_dir,
    output_dir,
    keys: dict | None = None,
    max_loras: int = 4,
    port: int = 0,
    report_to: tuple = (),
    **limits,
):
    from twinkle.server import ServerConfig, create_app
    from twinkle.server.state import Limits

    keys = keys or {KEY_A: Limits(**limits), KEY_B: Limits(**limits)}
    config = ServerConfig(
        model_id=str(tiny_model_dir),
        max_loras=max_loras,
        max_r=8,
        output_dir=output_dir,
        keys=keys,
        report_to=report_to,
    )
    return Running(create_app(config), port or free_port())
