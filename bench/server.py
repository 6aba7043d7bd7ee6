"""``twinkle server`` through the official Tinker SDK against training in-process.

    python bench/server.py --steps 16 --rounds 3 --out bench/results/server-MACHINE-DATE.md
    python bench/server.py --parts client --out bench/results/server-client-MACHINE-DATE.md
    python bench/server.py --quick --out /tmp/server.md   # checks the script end to end (tiny model)

Each arm trains a LoRA adapter (r 8, all linear layers, AdamW at 1e-4, no dropout) on W1
batches (``--batch`` bundled self-cognition rows, as ``bench/multi_lora.py`` builds them) on the
bundled SmolLM2-135M in fp32 unless ``--model`` says otherwise. The server runs as its own
process (``twinkle server``) on a local port; the SDK client runs here.

- ``sdk``: a step is ``forward_backward`` (cross entropy, weight 1 on each trained token) and
  ``optim_step`` through the SDK, against ``forward_backward`` + ``clip_grad_and_step`` of a
  ``MultiLoraTransformersModel`` here, the same batches; arms alternate round by round, medians
  reported. Target: SDK / in-process <= 1.10.
- ``client``: the same, the step being ``forward_backward`` + ``clip_grad_and_step`` of
  ``twinkle_client.model.MultiLoraTransformersModel`` (upstream's client class) over the server,
  against the same calls in-process (cross entropy, the mean over the trained tokens, the
  gradient clipped at the local default). Target: client / in-process <= 1.10.
- ``tenants``: two tenants training at once (a thread each, ``--steps`` steps each) against one
  tenant doing the same ``2 x --steps`` steps, each on a fresh server: combined throughput
  (steps/s) and the server's peak resident memory (``VmHWM``). Targets: throughput ratio >= 0.9,
  memory ratio <= 1.1.

Writes a markdown report to ``--out`` and prints it."""

import argparse
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness  # noqa: F401  (puts bench/harness on sys.path)
from multi_lora import batches, lora, timed
from shapes import CHOICES, model_path

KEYS = ("tml-bench-a", "tml-bench-b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``twinkle server`` in a child process, serving ``keys`` (default ``KEYS``). ``flags``: more of
    its command line (``--max-loras 4``); ``env``: more environment variables
    (``TWINKLE_OPERATOR_KEYS``); ``log``: a file for its stderr (default a pipe, read when it fails
    to start; a long run under load should give a file, which never fills up)."""

    def __init__(
        self,
        model_id: str | None,
        out: Path,
        keys: tuple[str, ...] | list[str] = KEYS,
        flags: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "twinkle.cli.main", "server", "--port", str(self.port)]
        cmd += ["--output-dir", str(out), "--max-r", "8", "--idle-timeout", "0"]
        cmd += ["--model-id", model_id] if model_id else []
        cmd += list(flags)
        env = {**os.environ, "TWINKLE_API_KEYS": ",".join(keys), "TINKER_TELEMETRY": "0", **(env or {})}
        self.log = log
        stderr = subprocess.PIPE if log is None else log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        if log is not None:
            stderr.close()  # the child holds its own copy
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        self.proc.wait(60)
        text = self.proc.stderr.read().decode() if log is None else log.read_text(errors="replace")
        raise SystemExit("the server did not start: " + text[-2000:])

    def _status(self, field: str) -> float:
        """A ``/proc/PID/status`` figure of the server in MiB (``VmHWM``, ``VmRSS``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def peak_rss_mib(self) -> float:
        return self._status("VmHWM")

    def rss_mib(self) -> float:
        return self._status("VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def sdk_trainer(url: str, key: str, base: str):
    import tinker

    os.environ["TINKER_TELEMETRY"] = "0"
    client = tinker.ServiceClient(base_url=url, api_key=key)
    # LoRA on the blocks only, as the in-process arm's (the server refuses train_unembed=True)
    return client.create_lora_training_client(base_model=base, rank=8, train_unembed=False).result()


def sdk_step(tc, data) -> None:
    from tinker import types

    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-4, eps=1e-8, beta2=0.999)).result()


def part_sdk(opts, rows, tmp: Path) -> list[str]:
    from twinkle.model import MultiLoraTransformersModel
    from twinkle_client.batches import datums_of, rows_of

    data = [datums_of(rows_of(b)) for b in rows]
    local = MultiLoraTransformersModel(opts.model_id, max_loras=1, max_r=8)
    local.add_adapter_to_model("a", lora(8, dropout=0.0))
    local.set_optimizer("AdamW", lr=1e-4, adapter_name="a")
    server = Server(opts.model_id, tmp / "sdk")
    try:
        tc = sdk_trainer(server.url, KEYS[0], opts.base)
        arms = {
            "in-process": lambda: [_local_step(local, b) for b in rows],
            "sdk": lambda: [sdk_step(tc, d) for d in data],
        }
        arms["in-process"](), arms["sdk"]()  # warm-up
        times = {k: [] for k in arms}
        for r in range(opts.rounds):
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                times[name].append(timed(arms[name]) / len(rows))
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return [
        "## SDK step vs in-process step",
        "",
        "| arm | median s/step | rounds |",
        "| --- | --- | --- |",
        *[f"| {k} | {med[k]:.4f} | {', '.join(f'{t:.4f}' for t in times[k])} |" for k in arms],
        "",
        f"SDK / in-process: **{med['sdk'] / med['in-process']:.3f}** (target <= 1.10)",
        "",
    ]


def part_client(opts, rows, tmp: Path) -> list[str]:
    from twinkle.model import MultiLoraTransformersModel
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel as ClientModel

    local = MultiLoraTransformersModel(opts.model_id, max_loras=1, max_r=8)
    local.add_adapter_to_model("a", lora(8, dropout=0.0))
    local.set_optimizer("AdamW", lr=1e-4, adapter_name="a")
    server = Server(opts.model_id, tmp / "client")
    try:
        init_twinkle_client(base_url=server.url, api_key=KEYS[0])
        remote = ClientModel(model_id=opts.base)
        remote.add_adapter_to_model("a", lora(8, dropout=0.0))
        remote.set_optimizer("AdamW", lr=1e-4, adapter_name="a")
        arms = {
            "in-process": lambda: [_local_step(local, b) for b in rows],
            "twinkle_client": lambda: [_local_step(remote, b) for b in rows],
        }
        arms["in-process"](), arms["twinkle_client"]()  # warm-up
        times = {k: [] for k in arms}
        for r in range(opts.rounds):
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                times[name].append(timed(arms[name]) / len(rows))
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return [
        "## twinkle_client step vs in-process step",
        "",
        "| arm | median s/step | rounds |",
        "| --- | --- | --- |",
        *[f"| {k} | {med[k]:.4f} | {', '.join(f'{t:.4f}' for t in times[k])} |" for k in arms],
        "",
        f"twinkle_client / in-process: **{med['twinkle_client'] / med['in-process']:.3f}** (target <= 1.10)",
        "",
    ]


def _local_step(model, batch) -> None:
    model.forward_backward(inputs=batch, adapter_name="a")
    model.clip_grad_and_step(adapter_name="a")


def _tenants(opts, rows, tmp: Path, count: int) -> tuple[float, float]:
    from twinkle_client.batches import datums_of, rows_of

    data = [datums_of(rows_of(b)) for b in rows]
    server = Server(opts.model_id, tmp / f"tenants-{count}")
    try:
        trainers = [sdk_trainer(server.url, KEYS[i], opts.base) for i in range(count)]
        steps = opts.steps * 2 // count

        def work(tc) -> None:
            for i in range(steps):
                sdk_step(tc, data[i % len(data)])

        threads = [threading.Thread(target=work, args=(tc,)) for tc in trainers]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        return steps * count / seconds, server.peak_rss_mib()
    finally:
        server.stop()


def part_tenants(opts, rows, tmp: Path) -> list[str]:
    one, two = [], []
    for r in range(opts.rounds):
        for count in (1, 2) if r % 2 == 0 else (2, 1):
            (one if count == 1 else two).append(_tenants(opts, rows, tmp, count))
    t1, t2 = statistics.median(x[0] for x in one), statistics.median(x[0] for x in two)
    m1, m2 = max(x[1] for x in one), max(x[1] for x in two)
    return [
        "## Two tenants at once vs one",
        "",
        "| tenants | steps/s (median) | server peak RSS MiB |",
        "| --- | --- | --- |",
        f"| 1 | {t1:.3f} | {m1:.0f} |",
        f"| 2 | {t2:.3f} | {m2:.0f} |",
        "",
        f"throughput 2/1: **{t2 / t1:.3f}** (target >= 0.9); memory 2/1: **{m2 / m1:.3f}** (target <= 1.1)",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=CHOICES, default="smollm2")
    p.add_argument("--steps", type=int, default=16, help="steps per round and arm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="rows per step (W1 rows)")
    p.add_argument("--parts", default="sdk,client,tenants")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--quick",
        action="store_true",
        help="check the script end to end: --model tiny --steps 2 --rounds 1 --batch 2 (its times mean nothing)",
    )
    opts = p.parse_args()
    if opts.quick:
        opts.model, opts.steps, opts.rounds, opts.batch = "tiny", 2, 1, 2
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        opts.model_id = model_path(opts.model, tmp / "model", seed=0)
        opts.base = opts.model_id or "bundled:SmolLM2-135M-Instruct"
        rows = batches(opts.model_id, opts.batch, opts.steps)
        lines = [
            f"# twinkle server vs in-process ({opts.model}, {datetime.date.today()})",
            "",
            f"`{' '.join(sys.argv)}` on {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs; batch {opts.batch} W1 rows, {opts.steps} steps, {opts.rounds} rounds",
            "",
        ]
        parts = opts.parts.split(",")
        if "sdk" in parts:
            lines += part_sdk(opts, rows, tmp)
        if "client" in parts:
            lines += part_client(opts, rows, tmp)
        if "tenants" in parts:
            lines += part_tenants(opts, rows, tmp)
    text = "\n".join(lines)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
