"""The product's docstrings and comments name no hardware and quote no measured timing (STYLE:
a docstring gives the reason, with at most one number that justifies it; measurements go to
``bench/results``). A timing holds on one machine, on one day; the reason holds everywhere.

What is read: every comment (``tokenize``) and every string that stands alone as a statement
(docstrings of modules, classes and functions, and attribute docstrings) in ``src/**/*.py``.
Code and other strings are not read: ``torch.device("cuda")``, a log line's ``"%.0f us"``.

Refused (``HARDWARE`` and ``TIMING`` below):

- hardware by name: CPU models and families (EPYC, Xeon, Zen 2, Graviton, ...), instruction
  sets (AVX2, AVX-512, AMX, NEON, SVE), accelerator models (A100, H100, H200, MI300, ...) and
  architectures (Hopper, Ampere, ...), and a machine's size ("2 cores", "a 2-core CPU", "16 vCPUs");
- measured time: a duration below a second ("20 ms", "30 us", "5 µs": where it is a setting's
  value, name the setting instead), a longer one given as measured ("takes about 5 s", "~3
  minutes"), a rate ("25 GB/s", "100 tokens/s"), a speed factor
  ("4x faster", "took 1.13x", "~30x slower") and a speed percentage ("25% slower", "40% more
  time").

Allowed, because they are not hardware names or measurements:

- device kinds and the names torch gives them: CPU, GPU, NPU, CUDA, MPS, XPU, Ascend (the
  ``npu`` backend's family), "cores" and "threads" without a count, "one thread";
- libraries and dtypes: oneDNN, MKL, BLAS, OpenMP, NCCL, gloo, Triton; bf16, fp16, fp32, tf32;
- a setting's value in seconds or longer ("a TTL of 1 s to 10 years", "retry after about 2 s",
  "retries for up to 5 minutes"), sizes ("513 MiB"), shapes ("1536 x 576"), precision ("about 1e-6 relative");
- a relative figure in words ("about half as fast", "twice as fast"), one per docstring, and a
  factor that is a size ratio ("2.5x the chunk").
"""

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

_NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)?"
_RANGE = rf"{_NUMBER}(?:\s*[-–]\s*\d+(?:\.\d+)?)?"
HARDWARE = re.compile(
    r"\b(?:"
    r"EPYC|Xeon|Zen ?[1-6]?|Ryzen|Threadripper|Core i[3579]|Skylake|Cascade ?Lake|Ice ?Lake"
    r"|(?:Sapphire|Emerald|Granite) ?Rapids|Graviton ?\d*|Neoverse|Apple M\d"
    r"|AVX(?:2|-?512[\w-]*)?|AMX|SSE[234](?:\.\d)?|NEON|SVE2?"
    r"|G?[ABHV]100|H[28]00|H20|G?B200|P100|A10G?|A30|A40|A6000|L40S?|L4|T4|RTX ?\d{3,4}|MI\d{3}X?"
    r"|Hopper|Ampere|Blackwell|Volta|Gaudi\d?|TPU ?v\d|Ascend ?910\w*"
    r"|(?:\d+|two|four|eight|sixteen)[- ](?:CPU cores?|physical cores?|v?cores?|v?CPUs?)"
    r")\b"
)
TIMING = re.compile(
    # below a second: always a measurement of code
    rf"{_RANGE}\s*(?:ns|us|µs|μs|ms|nanoseconds?|microseconds?|milliseconds?)\b"
    # a second or longer, given as measured (a setting's value is not: "retry after about 2 s")
    rf"|(?:~|\b(?:takes?|took|costs?|spends?|lasts?|lasted)\s+(?:about\s+|around\s+|roughly\s+)?)"
    rf"{_RANGE}\s*(?:s|secs?|seconds?|min|minutes?|h|hours?)\b"
    # a rate
    rf"|{_RANGE}\s*(?:[KMGT]i?B/s|tokens/s|tok/s|it/s|samples/s|rows/s|[GT]FLOP/?s|[GT]FLOPS)"
    # a speed factor: "4x faster", "took 1.13x", "~30x" (not "2.5x the chunk", a size)
    rf"|{_NUMBER}\s*[x×]\s+(?:faster|slower|quicker|as fast|as slow|the speed|the time)\b"
    rf"|{_NUMBER}[x×]\b(?!\s+the\b)"
    # a speed percentage
    rf"|{_NUMBER}\s*%\s+(?:faster|slower|quicker|more time|less time|longer|shorter|of the time|speed)"
)


def prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment and each string standing alone as a statement."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.append((node.lineno, node.value.value))
    return out


def findings(source: str) -> list[tuple[int, str]]:
    return [
        (line, match.group(0).strip())
        for line, text in prose(source)
        for pattern in (HARDWARE, TIMING)
        for match in pattern.finditer(text)
    ]


def _all() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        found = findings(path.read_text(encoding="utf-8"))
        if found:
            out[path.relative_to(SRC).as_posix()] = found
    return out


def test_no_hardware_names_or_timings_in_docstrings_and_comments():
    bad = [f"src/{path}:{line}: {text!r}" for path, found in _all().items() for line, text in found]
    assert not bad, (
        "docstrings and comments give the reason, not the machine or the measurement "
        "(a relative figure in words is fine; numbers go to bench/results):\n" + "\n".join(bad)
    )


def test_the_patterns_catch_what_they_must_and_pass_what_they_may():
    refused = [
        "# about 20 ms on 2 cores",
        "# 30 us a call on a 2-core EPYC",
        "# on a Zen 2 with AVX-512",
        "# an H100 or an A100",
        "# 4x faster for LoRA",
        "# about 25% slower",
        "# streams at about 25 GB/s",
        "# takes about 3 minutes",
        "# ~5 s a checkpoint",
        "# ~30x slower",
        "# 40% more time",
    ]
    allowed = [
        'x = torch.device("cuda")  # on the GPU or the CPU',
        "# a TTL of 1 s to 10 years",
        "# the SDK retries for up to 5 minutes; try again after about 2 s",
        "# 513 MiB of weights, a 1536 x 576 weight, about 1e-6 relative",
        "# about half as fast on one thread; twice as fast with oneDNN in fp32",
        "# (~2.5x the chunk) come on top",
        "# the cores and the threads; bf16 on an NPU (Ascend)",
        'LOG = "%.0f us"  # a log format is code, not prose',
    ]
    assert all(findings(line) for line in refused), [line for line in refused if not findings(line)]
    assert not any(findings(line) for line in allowed), [findings(line) for line in allowed]
