"""``twinkle server`` under load: N tenants at once, each training and sampling through the Tinker SDK.

    python bench/server_load.py --tenants 1,4,16 --seconds 60 --out bench/results/server-load-MACHINE-DATE.md
    python bench/server_load.py --model tiny --tenants 1,2 --seconds 5 --out /tmp/load.md   # checks the script
    python bench/server_load.py --sample-only --tenants 1,4,16 --seconds 60 --out bench/results/server-sampling-MACHINE-DATE.md

For each N of ``--tenants``, a fresh ``twinkle server`` (its own process, started as
``bench/server.py`` starts it) with N API keys, ``--max-loras`` ``--slots-per-tenant`` x N,
``--idle-timeout 0``, ``--rate`` requests/s per key (high: the limiter is not what is measured)
and an operator key, so ``GET /metrics`` can be scraped. The model is the bundled SmolLM2-135M in
fp32 unless ``--model`` says otherwise. Two slots per tenant (the default) keep every tenant's
run in its slot: a sample lends itself a slot for the call, and the server lets half its slots
hold paused samples; with ``--slots-per-tenant 1`` (``--max-loras`` N) each sample parks the least
recently used run (a save, and a load at its next request), which the report counts.

Each tenant is a thread with its own key and its own SDK ``ServiceClient``. It creates a LoRA
training run (r 8), warms up (steps on its share of the 8 batches, so that the tenants together
see every batch's shape once, one step at least; ``save_weights_and_get_sampling_client`` once;
one sample), waits for the others, then until ``--seconds`` have passed loops: ``forward_backward``
(cross entropy on a W1 batch of ``--batch`` bundled self-cognition rows, as ``bench/server.py``
builds them) and ``optim_step`` (AdamW at 1e-4) make a step; every ``--sample-every`` steps a
``sample`` from the sampler saved at the start (``num_samples`` 4, ``max_tokens`` 32, temperature
1, a seed per call, the prompt of the first bundled row). Each SDK call is timed end to end, from
the call to its ``.result()``. With ``--sample-only`` the timed loop only samples, back to back:
the tenants' samples then meet in the server's shared decoding batch (each row through its own
tenant's adapter), and sampled tokens/s from 1 to N tenants measures what that batching gains.

Reported per N:

- per request type (``forward_backward``, ``optim_step``, ``sample``, and the step as the pair):
  count, requests/s over the timed window, p50/p99/max latency, errors; tokens through
  ``forward_backward`` per second (all input tokens, the server's count, and the supervised ones)
  and sampled tokens per second; each tenant's steps (min, median, max: round robin's fairness
  between tenants).
- from the server (``/metrics`` before and after the timed window, and ``/api/v1/usage`` of each
  key): requests answered by lane and outcome, tokens trained and sampled, the mean seconds from
  queued to answered per lane; at the end the queue depth, adapter slots in use, runs live and
  parked.
- nothing lost: every call a client made came back (sent = answered), none failed, and the
  server answered exactly as many requests and counted exactly the tokens the clients sent, in
  all and for each key.
- nothing leaked: the server's resident memory (``VmRSS``, read every 0.5 s) after the warm-up, in
  the middle of the window and at the end, and its growth per request over the window's second
  half (the first half still fills allocator caches; a finished request's future is kept 60 s
  after it is retrieved, so a window shorter than that holds every one of its answers); both
  queues empty at the end, and the adapter slots in use back to one per tenant (a sample lends a
  slot for the call).
- fairness, for the largest N: ``forward_backward`` latency while another tenant's sample was in
  flight against while none was.

The machine line reads the CPU from ``/proc/cpuinfo`` and counts the CPU time other processes
used during the timed windows (``/proc/stat`` less the server's and this process's), so a run
that shared the machine says so. Writes a markdown report to ``--out`` (and prints it), and
everything measured, every call included, to the ``.json`` beside it."""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import harness  # noqa: F401  (puts bench/harness on sys.path)
import numpy as np
from multi_lora import batches
from server import Server
from shapes import CHOICES, model_path

TYPES = ("forward_backward", "optim_step", "sample")
OPERATOR = "bench-load-operator-0123456789"  # /metrics' key (16 characters at least)
LANE = {"forward_backward": "train", "optim_step": "train", "sample": "sample"}
NAN = float("nan")
MAX_ERRORS = 20  # a tenant stops after this many failed calls in a row (the server is gone)


def keys_of(count: int) -> list[str]:
    return [f"tml-load-{i:02d}" for i in range(count)]


class Batch:
    """One W1 batch as Tinker datums, with its input tokens (what the server counts as trained)
    and its supervised tokens (weight 1)."""

    def __init__(self, rows):
        from twinkle_client.batches import datums_of

        self.datums = datums_of(rows)
        self.supervised = int(sum(d.loss_fn_inputs["weights"].to_numpy().sum() for d in self.datums))
        self.tokens = sum(d.model_input.length for d in self.datums)


def prompt_of(batch: Batch) -> list[int]:
    """The first row's prompt: its tokens up to where the reply (the first weighted target) starts."""
    d = batch.datums[0]
    weights = d.loss_fn_inputs["weights"].tolist()
    first = next(i for i, w in enumerate(weights) if w > 0)
    return d.model_input.to_ints()[: first + 1]


class Tenant(threading.Thread):
    """One key's client: set-up and warm-up, then the timed loop (``run``)."""

    def __init__(self, index: int, key: str, url: str, opts, data: list[Batch], prompt: list[int], sync):
        super().__init__(name=f"tenant-{index}", daemon=True)
        self.index, self.key, self.url, self.opts = index, key, url, opts
        self.data, self.prompt, self.sync = data, prompt, sync
        self.sent = dict.fromkeys(TYPES, 0)
        self.calls: list[dict] = []  # {type, start, end, error, tokens}
        self.steps = 0
        self.failed: str | None = None  # the set-up's traceback
        self.client = None

    def run(self) -> None:
        from tinker import types

        opts = self.opts
        self.adam = types.AdamParams(learning_rate=1e-4, eps=1e-8, beta2=0.999)
        self.params = lambda seed: types.SamplingParams(
            max_tokens=opts.max_tokens, temperature=1.0, seed=seed
        )
        self.model_input = types.ModelInput.from_ints(self.prompt)
        try:
            import tinker

            self.client = tinker.ServiceClient(base_url=self.url, api_key=self.key)
            self.trainer = self.client.create_lora_training_client(
                base_model=opts.base, rank=8, train_unembed=False
            ).result(timeout=opts.call_timeout)
            # the batches' shapes once in all (tenant i: batches i, i + N, ...), at least one step each
            for j in range(self.index, len(self.data), self.sync["count"]) or [self.index % len(self.data)]:
                self._step_untimed(self.data[j])
            self.sampler = self.trainer.save_weights_and_get_sampling_client().result(
                timeout=opts.call_timeout
            )
            self.sampler.sample(self.model_input, opts.num_samples, self.params(0)).result(
                timeout=opts.call_timeout
            )
        except Exception:  # noqa: BLE001 (reported by the main thread)
            self.failed = traceback.format_exc()
            self.sync["ready"].abort()
            return
        try:
            self.sync["ready"].wait()
        except threading.BrokenBarrierError:  # another tenant's set-up failed
            return
        self.sync["go"].wait()
        self._loop(self.sync["deadline"])

    def _step_untimed(self, batch: Batch) -> None:
        self.trainer.forward_backward(batch.datums, "cross_entropy").result(timeout=self.opts.call_timeout)
        self.trainer.optim_step(self.adam).result(timeout=self.opts.call_timeout)

    def _loop(self, deadline: float) -> None:
        opts, wait, in_a_row = self.opts, self.opts.call_timeout, 0
        while opts.sample_only and time.perf_counter() < deadline and in_a_row < MAX_ERRORS:
            seed = opts.seed + 100_000 * self.index + len(self.calls)
            ok = self._call(
                "sample",
                lambda s=seed: self.sampler.sample(self.model_input, opts.num_samples, self.params(s)).result(
                    timeout=wait
                ),
            )
            in_a_row = 0 if ok else in_a_row + 1
        while not opts.sample_only and time.perf_counter() < deadline and in_a_row < MAX_ERRORS:
            batch = self.data[(self.index + self.steps) % len(self.data)]
            ok = self._call(
                "forward_backward",
                lambda b=batch: self.trainer.forward_backward(b.datums, "cross_entropy").result(timeout=wait),
                tokens=batch.tokens,
                supervised=batch.supervised,
            )
            ok &= self._call("optim_step", lambda: self.trainer.optim_step(self.adam).result(timeout=wait))
            self.steps += 1
            if self.steps % opts.sample_every == 0 and time.perf_counter() < deadline:
                seed = opts.seed + 100_000 * self.index + self.steps
                ok &= self._call(
                    "sample",
                    lambda s=seed: self.sampler.sample(
                        self.model_input, opts.num_samples, self.params(s)
                    ).result(timeout=wait),
                )
            in_a_row = 0 if ok else in_a_row + 1

    def _call(self, kind: str, fn, **extra) -> bool:
        self.sent[kind] += 1
        record = {"type": kind, "error": None, **extra}
        record["start"] = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 (counted and reported)
            out, record["error"] = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        record["end"] = time.perf_counter()
        if kind == "sample" and out is not None:
            record["sampled"] = sum(len(s.tokens) for s in out.sequences)
        self.calls.append(record)
        return record["error"] is None

    def close(self, timeout: float) -> None:
        if self.client is not None:
            try:
                self.client.close("success").result(timeout=timeout)
            except Exception:  # noqa: BLE001, S110 (the server stops next anyway)
                pass


# ---------------------------------------------------------------------- the server's side


def scrape(server: Server) -> dict[tuple, float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30)
    r.raise_for_status()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def usage(server: Server, key: str) -> dict:
    import httpx

    r = httpx.get(f"{server.url}/api/v1/usage", headers={"X-API-Key": key}, timeout=30)
    r.raise_for_status()
    return r.json()


def cpu_busy() -> float | None:
    """CPU-seconds every CPU of the machine spent busy so far (``/proc/stat``)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    guest = sum(fields[8:10])  # counted in user and nice already
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """CPU-seconds of process ``pid`` and its waited-for children."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(x) for x in rest[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def cpu_snapshot(server: Server) -> dict:
    own = os.times()
    return {"busy": cpu_busy(), "server": cpu_of(server.proc.pid), "bench": own.user + own.system}


def settled(server: Server, answered: int, wait: float = 5.0) -> dict:
    """``/metrics`` once the server has counted ``answered`` queued requests (a request is counted
    right after its answer is ready, so a scrape can come a moment early), or after ``wait`` s."""
    end = time.monotonic() + wait
    while True:
        samples = scrape(server)
        counted = sum(v for (n, _), v in samples.items() if n == "twinkle_server_requests_total")
        if counted >= answered or time.monotonic() > end:
            return samples
        time.sleep(0.1)


# ---------------------------------------------------------------------- one N


def run_tenants(opts, count: int, data: list[Batch], prompt: list[int], tmp: Path) -> dict:
    keys = keys_of(count)
    slots = max(1, opts.slots_per_tenant * count)
    flags = ["--max-loras", str(slots), "--rate", f"{opts.rate:g}"]
    server = Server(
        opts.model_id,
        tmp / f"out-{count}",
        keys=keys,
        flags=flags,
        env={"TWINKLE_OPERATOR_KEYS": OPERATOR},
        log=tmp / f"server-{count}.log",
    )
    sync = {"ready": threading.Barrier(count + 1), "go": threading.Event(), "deadline": 0.0, "count": count}
    tenants = [Tenant(i, k, server.url, opts, data, prompt, sync) for i, k in enumerate(keys)]
    try:
        for t in tenants:
            t.start()
        try:
            sync["ready"].wait(timeout=opts.call_timeout * 4)
        except threading.BrokenBarrierError:
            failed = [t.failed for t in tenants if t.failed]
            raise SystemExit(
                f"{count} tenants: the set-up failed\n{failed[0] if failed else 'timed out'}\n"
                f"server log ({server.log}):\n{server.log.read_text(errors='replace')[-3000:]}"
            ) from None
        time.sleep(0.2)  # the warm-up's last request is counted
        before = scrape(server)
        usage_before = {k: usage(server, k) for k in keys}
        rss_warm = server.rss_mib()
        cpu_before = cpu_snapshot(server)
        start = time.perf_counter()
        sync["deadline"] = start + opts.seconds
        sync["go"].set()
        rss, stop = [(0.0, rss_warm, 0)], threading.Event()
        watch = threading.Thread(target=_watch_rss, args=(server, tenants, start, rss, stop), daemon=True)
        watch.start()
        for t in tenants:
            t.join(timeout=max(0.0, sync["deadline"] + opts.call_timeout + 30 - time.perf_counter()))
        ended = time.perf_counter()
        stop.set()
        watch.join()
        cpu_after = cpu_snapshot(server)
        hung = [t.index for t in tenants if t.is_alive()]
        calls = [
            {**c, "tenant": t.index, "start": c["start"] - start, "end": c["end"] - start}
            for t in tenants
            for c in list(t.calls)
        ]
        counted = sum(v for (n, _), v in before.items() if n == "twinkle_server_requests_total")
        failure = None
        try:
            after = settled(server, int(counted) + len(calls))
            usage_after = {k: usage(server, k) for k in keys}
        except Exception as exc:  # noqa: BLE001 (the server is gone: every check fails, and says why)
            failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
            after, usage_after = (
                {},
                {k: {"queued": -1, "requests": {"train": -1, "sample": -1}} for k in keys},
            )
        rss_end, peak = _mib(server.rss_mib), _mib(server.peak_rss_mib)
        parked_dirs = len(list((tmp / f"out-{count}").rglob("parked-*")))
        for t in tenants:
            if not t.is_alive():
                t.close(timeout=30)
    finally:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 (it did not stop in time)
            server.proc.kill()
    log = server.log.read_text(errors="replace").splitlines()
    wall = max([c["end"] for c in calls], default=ended - start)
    return {
        "tenants": count,
        "max_loras": slots,
        "wall_s": wall,
        "calls": calls,
        "sent": {k: sum(t.sent[k] for t in tenants) for k in TYPES},
        "steps": [t.steps for t in tenants],
        "hung": hung,
        "server": {
            "before": _flat(before),
            "after": _flat(after),
            "usage_before": usage_before,
            "usage_after": usage_after,
            "rss_after_warmup_mib": rss_warm,
            "rss_end_mib": rss_end,
            "rss_timeline": rss,  # (seconds into the window, MiB, calls answered so far)
            "peak_rss_mib": peak,
            "parked_checkpoints": parked_dirs,
            "failure": failure,  # why /metrics or /usage could not be read after the window
            "log_lines": len(log),
            "log_tail": log[-40:],
        },
        "cpu": {k: cpu_after[k] - cpu_before[k] if cpu_before[k] is not None else None for k in cpu_before},
        "cpu_window_s": ended - start,
    }


def _mib(read) -> float:
    try:
        return read()
    except OSError:  # the server is gone
        return float("nan")


def _watch_rss(server: Server, tenants: list, start: float, out: list, stop: threading.Event) -> None:
    """The server's RSS every 0.5 s of the timed window, with the calls answered so far."""
    while not stop.wait(0.5):
        try:
            out.append((time.perf_counter() - start, server.rss_mib(), sum(len(t.calls) for t in tenants)))
        except OSError:  # the server is gone
            return


def _flat(samples: dict) -> dict[str, float]:
    return {
        name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}": value
        for (name, labels), value in samples.items()
    }


def _get(flat: dict, name: str, default: float = 0.0, **labels) -> float:
    return flat.get(name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}", default)


# ---------------------------------------------------------------------- figures


def stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    a = np.asarray(values)
    return {
        "count": len(values),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def summarize(r: dict) -> dict:
    """The figures of one N, from its calls and the server's counters."""
    calls, wall = r["calls"], r["wall_s"]
    out: dict = {"types": {}}
    for kind in TYPES:
        mine = [c for c in calls if c["type"] == kind]
        good = [c["end"] - c["start"] for c in mine if c["error"] is None]
        out["types"][kind] = {
            **stats(good),
            "per_s": len(good) / wall,
            "errors": sum(c["error"] is not None for c in mine),
            "sent": r["sent"][kind],
            "answered": len(mine),
        }
    pairs = _steps(calls)
    out["types"]["step"] = {**stats(pairs), "per_s": len(pairs) / wall, "errors": 0}
    fb_ok = [c for c in calls if c["type"] == "forward_backward" and c["error"] is None]
    sm_ok = [c for c in calls if c["type"] == "sample" and c["error"] is None]
    out["tokens"] = sum(c["tokens"] for c in fb_ok)
    out["supervised"] = sum(c["supervised"] for c in fb_ok)
    out["sampled"] = sum(c.get("sampled", 0) for c in sm_ok)
    s = r["server"]
    before, after = s["before"], s["after"]

    def delta(name: str, **labels) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    out["server"] = {
        "requests": {
            f"{lane} {o}": delta("twinkle_server_requests_total", lane=lane, outcome=o)
            for lane in ("train", "sample")
            for o in ("ok", "error")
        },
        "tokens_trained": delta("twinkle_server_tokens_total", kind="trained"),
        "tokens_sampled": delta("twinkle_server_tokens_total", kind="sampled"),
        "mean_s": {
            lane: delta("twinkle_server_request_seconds_sum", lane=lane)
            / max(1.0, delta("twinkle_server_request_seconds_count", lane=lane))
            for lane in ("train", "sample")
        },
        # gauges: not a number when the scrape after the window failed
        "depth_end": {
            lane: _get(after, "twinkle_server_queue_depth", NAN, lane=lane) for lane in ("train", "sample")
        },
        "slots_used": _get(after, "twinkle_server_adapter_slots", NAN, state="used"),
        "runs_live": _get(after, "twinkle_server_runs", NAN, state="live"),
        "runs_parked": _get(after, "twinkle_server_runs", NAN, state="parked"),
    }
    per_key = []
    for (key, b), a in zip(s["usage_before"].items(), s["usage_after"].values(), strict=True):
        i = int(key.rsplit("-", 1)[1])
        mine = [c for c in calls if c["tenant"] == i and c["error"] is None]
        want = {lane: sum(LANE[c["type"]] == lane for c in mine) for lane in ("train", "sample")}
        got = {lane: a["requests"][lane] - b["requests"][lane] for lane in ("train", "sample")}
        per_key.append(want == got and a["queued"] == 0)
    out["keys_match"] = sum(per_key)
    sent = sum(r["sent"].values())
    answered = len(calls)
    errors = sum(c["error"] is not None for c in calls)
    srv = out["server"]["requests"]
    out["lost"] = {
        "sent": sent,
        "answered": answered,
        "errors": errors,
        "server_answered": sum(srv.values()),
        "server_errors": srv["train error"] + srv["sample error"],
        "ok": sent == answered
        and errors == 0
        and not r["hung"]
        and srv["train ok"] == sum(1 for c in calls if LANE[c["type"]] == "train")
        and srv["sample ok"] == sum(1 for c in calls if c["type"] == "sample")
        and srv["train error"] + srv["sample error"] == 0
        and out["server"]["tokens_trained"] == out["tokens"]
        and out["server"]["tokens_sampled"] == out["sampled"]
        and out["keys_match"] == r["tenants"],
    }
    depth = out["server"]["depth_end"]
    timeline = s["rss_timeline"]
    mid = min(timeline, key=lambda x: abs(x[0] - wall / 2))  # the sample nearest the window's middle
    late = len(calls) - mid[2]
    out["leaked"] = {
        "rss_growth_mib": s["rss_end_mib"] - s["rss_after_warmup_mib"],
        "rss_mid_mib": mid[1],
        "rss_late_growth_mib": s["rss_end_mib"] - mid[1],
        "late_requests": late,
        "rss_late_kib_per_request": 1024 * (s["rss_end_mib"] - mid[1]) / max(1, late),
        "queues_empty": depth["train"] == 0 and depth["sample"] == 0,
        "slots_back": out["server"]["slots_used"] == r["tenants"],
    }
    out["fairness"] = _fairness(calls)
    return out


def _steps(calls: list[dict]) -> list[float]:
    """Each step's seconds: a ``forward_backward`` and the ``optim_step`` after it, both answered."""
    by_tenant: dict[int, list[dict]] = {}
    for c in calls:
        by_tenant.setdefault(c["tenant"], []).append(c)
    out = []
    for mine in by_tenant.values():
        mine.sort(key=lambda c: c["start"])
        for fb, opt in zip(mine, mine[1:], strict=False):
            if (
                fb["type"] == "forward_backward"
                and opt["type"] == "optim_step"
                and not (fb["error"] or opt["error"])
            ):
                out.append(opt["end"] - fb["start"])
    return out


def _fairness(calls: list[dict]) -> dict:
    """``forward_backward`` latency while another tenant's sample was in flight, and while none was."""
    samples = [c for c in calls if c["type"] == "sample"]
    starts = np.array([c["start"] for c in samples])
    ends = np.array([c["end"] for c in samples])
    owners = np.array([c["tenant"] for c in samples])
    during, alone = [], []
    for c in calls:
        if c["type"] != "forward_backward" or c["error"]:
            continue
        overlap = len(samples) and bool(
            ((starts < c["end"]) & (ends > c["start"]) & (owners != c["tenant"])).any()
        )
        (during if overlap else alone).append(c["end"] - c["start"])
    return {"during_samples": stats(during), "no_sample": stats(alone)}


# ---------------------------------------------------------------------- the report


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
        )
        mem = f"{int(mem.split()[1]) / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        mem = "memory unknown"
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} CPUs, {mem}, {gpu}"


def f3(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def section(r: dict, s: dict) -> list[str]:
    n, wall = r["tenants"], r["wall_s"]
    steps = r["steps"]
    lines = [
        f"## {n} tenant{'s' if n > 1 else ''} (`--max-loras {r['max_loras']}`, {wall:.1f} s timed)",
        "",
        "| request | count | requests/s | p50 s | p99 s | max s | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in (*TYPES, "step"):
        t = s["types"][kind]
        name = "step (forward_backward + optim_step)" if kind == "step" else kind
        lines.append(
            f"| {name} | {t['count']} | {t['per_s']:.2f} | {f3(t['p50'])} | {f3(t['p99'])} | {f3(t['max'])} | "
            f"{t['errors']} |"
        )
    srv, lost, leaked = s["server"], s["lost"], s["leaked"]
    lines += [
        "",
        f"Trained {s['tokens'] / wall:,.0f} tokens/s through `forward_backward` "
        f"({s['supervised'] / wall:,.0f} supervised); sampled {s['sampled'] / wall:,.0f} tokens/s. "
        f"Steps per tenant: min {min(steps)}, median {statistics.median(steps):g}, max {max(steps)}.",
        "",
        "| check | clients | server | ok |",
        "| --- | --- | --- | --- |",
        f"| requests answered | sent {lost['sent']}, answered {lost['answered']}, errors {lost['errors']}"
        f"{', hung tenants ' + str(r['hung']) if r['hung'] else ''} | "
        + ", ".join(f"{k} {v:.0f}" for k, v in srv["requests"].items())
        + f" | {_yes(lost['ok'])} |",
        f"| tokens trained, sampled | {s['tokens']}, {s['sampled']} | "
        f"{srv['tokens_trained']:.0f}, {srv['tokens_sampled']:.0f} | "
        f"{_yes(srv['tokens_trained'] == s['tokens'] and srv['tokens_sampled'] == s['sampled'])} |",
        f"| each key's requests (`/api/v1/usage`) | {_plural(n, 'key')} | {s['keys_match']} with the clients' counts, none queued | "
        f"{_yes(s['keys_match'] == n)} |",
        f"| queue depth at the end (train, sample) | | {srv['depth_end']['train']:.0f}, "
        f"{srv['depth_end']['sample']:.0f} | {_yes(leaked['queues_empty'])} |",
        f"| adapter slots in use at the end | {_plural(n, 'run')} | {srv['slots_used']:.0f} (runs live "
        f"{srv['runs_live']:.0f}, parked {srv['runs_parked']:.0f}) | {_yes(leaked['slots_back'])} |",
        f"| server RSS: after the warm-up, mid-window, end (peak) | | "
        f"{r['server']['rss_after_warmup_mib']:.0f}, {leaked['rss_mid_mib']:.0f}, "
        f"{r['server']['rss_end_mib']:.0f} MiB ({r['server']['peak_rss_mib']:.0f}) | "
        f"{leaked['rss_growth_mib']:+.0f} MiB in all; {leaked['rss_late_growth_mib']:+.0f} MiB over the "
        f"second half's {leaked['late_requests']} requests ({leaked['rss_late_kib_per_request']:+.1f} KiB each) |",
        "",
        f"Server's mean seconds from queued to answered: train {srv['mean_s']['train']:.3f}, sample "
        f"{srv['mean_s']['sample']:.3f}. Runs parked at least once (a `parked-*` checkpoint): "
        f"{r['server']['parked_checkpoints']}. {_log_note(r['server'])}",
        "",
    ]
    if r["server"]["failure"]:
        lines += [f"**The server did not answer after the window**: {r['server']['failure']}", ""]
    return lines


def _log_note(server: dict) -> str:
    """The server's stderr in a few words: how many lines, and its last."""
    note = f"The server's stderr: {_plural(server['log_lines'], 'line')}"
    if server["log_tail"]:
        return note + f" (the last: `{server['log_tail'][-1][:200]}`; the last 40 in the .json)."
    return note + "."


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**NO**"


def cpu_line(results: list[dict]) -> str:
    busy = [r["cpu"]["busy"] for r in results]
    if any(b is None for b in busy):
        return "other processes' CPU time: not measured (no /proc/stat)"
    others = sum(r["cpu"]["busy"] - r["cpu"]["server"] - r["cpu"]["bench"] for r in results)
    window = sum(r["cpu_window_s"] for r in results)
    return (
        f"other processes used {max(0.0, others):.1f} CPU-s of the {window * (os.cpu_count() or 1):.0f} "
        f"CPU-s the timed windows had ({100 * max(0.0, others) / (window * (os.cpu_count() or 1)):.1f}%)"
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b else NAN


def conclusion(results: list[dict], sums: list[dict]) -> str:
    first, last = sums[0], sums[-1]
    n0, n1 = results[0]["tenants"], results[-1]["tenants"]
    fb0, fb1 = first["types"]["forward_backward"], last["types"]["forward_backward"]
    st0, st1 = first["types"]["step"], last["types"]["step"]
    lost = [r["tenants"] for r, s in zip(results, sums, strict=True) if not s["lost"]["ok"]]
    leaks = [
        r["tenants"]
        for r, s in zip(results, sums, strict=True)
        if not (s["leaked"]["queues_empty"] and s["leaked"]["slots_back"])
    ]
    late = [s["leaked"]["rss_late_kib_per_request"] for s in sums]
    late = max((x for x in late if x == x), default=NAN)
    if n0 == n1:
        parts = [
            f"At {n1} tenant{'s' if n1 > 1 else ''} the server ran {st1['per_s']:.2f} steps/s, "
            f"`forward_backward` p99 {fb1['p99']:.3f} s"
        ]
    else:
        parts = [
            f"From {n0} to {n1} tenants the server's steps/s went {st0['per_s']:.2f} -> {st1['per_s']:.2f} "
            f"({_ratio(st1['per_s'], st0['per_s']):.2f}x) and `forward_backward` p99 {fb0['p99']:.3f} -> "
            f"{fb1['p99']:.3f} s ({_ratio(fb1['p99'], fb0['p99']):.1f}x, {n1 / n0:g}x the tenants)"
        ]
    sm0, sm1 = first["types"]["sample"], last["types"]["sample"]
    tok0, tok1 = first["sampled"] / results[0]["wall_s"], last["sampled"] / results[-1]["wall_s"]
    if n0 != n1:
        parts.append(
            f"sampled tokens/s {tok0:,.0f} -> {tok1:,.0f} ({_ratio(tok1, tok0):.2f}x) and `sample` p99 "
            f"{sm0['p99']:.3f} -> {sm1['p99']:.3f} s (the tenants' samples share one decoding batch)"
        )
    fair = last["fairness"]
    if fair["during_samples"]["count"] and fair["no_sample"]["count"]:
        parts.append(
            f"at {n1}, `forward_backward` p99 while another tenant sampled is "
            f"{fair['during_samples']['p99'] / fair['no_sample']['p99']:.2f}x its p99 when none did"
        )
    parts.append(
        "nothing lost" if not lost else f"requests lost or failed at N = {', '.join(map(str, lost))}"
    )
    parts.append(
        "queues empty and slots back at every N"
        if not leaks
        else f"leftovers at N = {', '.join(map(str, leaks))}"
    )
    parts.append(f"server RSS over a window's second half: at most {late:+.1f} KiB per request")
    return "; ".join(parts) + "."


def report(opts, results: list[dict], sums: list[dict], load: tuple[float, float, float]) -> str:
    command = " ".join(["python", "bench/server_load.py", *sys.argv[1:]])
    lines = [
        f"# twinkle server under load: {', '.join(str(r['tenants']) for r in results)} tenants "
        f"({opts.model}, {datetime.date.today()})",
        "",
        f"Machine: {machine()}; load average before the run {load[0]:.2f} (1 min), {load[1]:.2f} (5 min); "
        f"{cpu_line(results)}; {datetime.date.today()}.",
        "",
        "```bash",
        command,
        "```",
        "",
        (
            f"Each tenant: a LoRA run (r 8) and its sampler; samples back to back (`num_samples` "
            f"{opts.num_samples}, `max_tokens` {opts.max_tokens}, temperature 1) for {opts.seconds:g} s; "
            if opts.sample_only
            else f"Each tenant: a LoRA run (r 8), steps of `forward_backward` on {opts.batch} W1 rows + "
            f"`optim_step` (AdamW 1e-4), a sample every {opts.sample_every} steps (`num_samples` "
            f"{opts.num_samples}, `max_tokens` {opts.max_tokens}, temperature 1) for {opts.seconds:g} s; "
        )
        + "latency per SDK call "
        f"from the call to its `.result()`; `--max-loras` {opts.slots_per_tenant} x tenants, `--rate` "
        f"{opts.rate:g}, `--idle-timeout 0`.",
        "",
        "| tenants | steps/s | fwd_bwd p50 s | fwd_bwd p99 s | sample p50 s | sample p99 s | trained tokens/s "
        "| sampled tokens/s | lost | queues empty, slots back | RSS growth MiB (second half) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, s in zip(results, sums, strict=True):
        t = s["types"]
        lines.append(
            f"| {r['tenants']} | {t['step']['per_s']:.2f} | {f3(t['forward_backward']['p50'])} | "
            f"{f3(t['forward_backward']['p99'])} | {f3(t['sample']['p50'])} | {f3(t['sample']['p99'])} | "
            f"{s['tokens'] / r['wall_s']:,.0f} | {s['sampled'] / r['wall_s']:,.0f} | "
            f"{'none' if s['lost']['ok'] else '**yes**'} | "
            f"{_yes(s['leaked']['queues_empty'] and s['leaked']['slots_back'])} | "
            f"{s['leaked']['rss_growth_mib']:+.0f} ({s['leaked']['rss_late_growth_mib']:+.0f}) |"
        )
    lines.append("")
    for r, s in zip(results, sums, strict=True):
        lines += section(r, s)
    r, s = results[-1], sums[-1]
    fair = s["fairness"]
    if r["tenants"] > 1:
        d, a = fair["during_samples"], fair["no_sample"]
        lines += [
            f"## Fairness at {r['tenants']} tenants: `forward_backward` while others sample",
            "",
            "| forward_backward calls | count | p50 s | p99 s | max s |",
            "| --- | --- | --- | --- | --- |",
            f"| while another tenant's sample was in flight | {d['count']} | {f3(d['p50'])} | {f3(d['p99'])} | "
            f"{f3(d['max'])} |",
            f"| while no other tenant's sample was | {a['count']} | {f3(a['p50'])} | {f3(a['p99'])} | "
            f"{f3(a['max'])} |",
            "",
        ]
    lines += [conclusion(results, sums), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=CHOICES, default="smollm2", help="see bench/harness/shapes.py")
    p.add_argument("--tenants", default="1,4,16", help="comma-separated tenant counts, a fresh server each")
    p.add_argument("--seconds", type=float, default=60.0, help="timed seconds per tenant count")
    p.add_argument("--batch", type=int, default=4, help="W1 rows per forward_backward")
    p.add_argument("--sample-every", type=int, default=2, help="a sample after every this many steps")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per sequence")
    p.add_argument(
        "--slots-per-tenant",
        type=int,
        default=2,
        help="--max-loras = this x tenants (default 2: a sample lends a slot for its call, and the "
        "server lets half the slots hold paused samples; 1 makes every sample park a tenant's run)",
    )
    p.add_argument("--rate", type=float, default=1000.0, help="the server's --rate, requests/s per key")
    p.add_argument("--call-timeout", type=float, default=300.0, help="seconds one SDK call may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sample-only",
        action="store_true",
        help="the timed loop only samples, back to back (the shared decoding batch's throughput)",
    )
    p.add_argument("--out", type=Path, required=True, help="the markdown report; the .json beside it")
    opts = p.parse_args()
    counts = sorted({int(x) for x in opts.tenants.split(",") if x.strip()})
    if (
        not counts
        or min(counts) < 1
        or opts.seconds <= 0
        or opts.sample_every < 1
        or opts.slots_per_tenant < 1
    ):
        raise SystemExit(
            "--tenants needs counts >= 1; --seconds, --sample-every, --slots-per-tenant positive"
        )
    os.environ["TINKER_TELEMETRY"] = "0"
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        opts.model_id = model_path(opts.model, tmp / "model", seed=0)
        opts.base = opts.model_id or "bundled:SmolLM2-135M-Instruct"
        data = [Batch(rows) for rows in batches(opts.model_id, opts.batch, 8)]
        prompt = prompt_of(data[0])
        results = []
        for count in counts:
            print(f"{count} tenants: {opts.seconds:g} s ...", file=sys.stderr, flush=True)
            results.append(run_tenants(opts, count, data, prompt, tmp))
    sums = [summarize(r) for r in results]
    text = report(opts, results, sums, load)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(text)
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}
    dump = {
        "args": args,
        "prompt_tokens": len(prompt),
        "runs": [{**r, "summary": s} for r, s in zip(results, sums, strict=True)],
    }
    opts.out.with_suffix(".json").write_text(json.dumps(dump, indent=1, default=float))
    print(text)


if __name__ == "__main__":
    main()
