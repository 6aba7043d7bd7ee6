#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run of under 10 minutes on an H200: the CUDA tests
# (tests/gpu: kernelized models on both kernel chains, LoRA dropout and Muon on CUDA, FSDP2 on one
# rank and, with 2+ GPUs, on two), what is alive at W2's peak of GPU memory
# (bench/micro/profile_step.py --memory), one bench round on the contract's defaults (W1, then W2,
# on a Qwen2.5-0.5B-shaped model built from a config, bf16, --config contract: Muon, LoRA dropout
# 0.05; the Trainer side with Liger when it is installed), then a profile of W1's ops. Each step
# has its own time limit, so one that hangs does not take the others with it. Every figure lands
# in OUT_DIR: the logs, results_gpu_W1.json, results_gpu_W2.json and summary.txt (the commit, the
# GPU, the tests' outcome, each workload's step times, tokens/s and peak GPU MiB).
#
#   scripts/gpu_check.sh OUT_DIR [TOKENIZER_DIR] [SECONDS]
#
# TOKENIZER_DIR: a folder of tokenizer files, for a machine without the bundled GGUF (bench/README.md).
# SECONDS: the whole run's budget (default 540). PYTHON: the interpreter (default python3); MODEL:
# the bench model (default qwen2.5-0.5b; tiny to try the script on a CPU); COMMIT: the commit to
# record where the tree has no .git.
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [TOKENIZER_DIR] [SECONDS]}
tok=${2:-}
budget=${3:-540}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

left() { echo $((budget - SECONDS)); }
bench() { # bench NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    echo "== bench $name ($limit s at most): $*"
    timeout "$limit" "$py" bench/run.py --model "${MODEL:-qwen2.5-0.5b}" ${tok:+--tokenizer "$tok"} \
        --out "$out/results_gpu_$name.json" "$@" 2>&1 | tee "$out/bench_$name.log" | grep -v '^\[' || true
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
"$py" - <<'EOF'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("transformers", "peft", "accelerate", "liger-kernel", "triton", "datasets", "huggingface_hub"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "not installed")
EOF

{
    # COMMIT: the commit, where the copy on the GPU machine has no .git
    echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}$(git diff --quiet HEAD 2>/dev/null || echo ' with local changes')"
    echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu /'
} >"$out/summary.txt"

echo "== CUDA tests ($(left) s left)"
timeout 150 "$py" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -30
echo "tests: $(grep -E '(passed|failed|skipped|error)' "$out/gpu_tests.log" | tail -1)" >>"$out/summary.txt"
profile() { # profile NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    echo "== profile $name ($limit s at most): $*"
    timeout "$limit" "$py" bench/micro/profile_step.py --model "${MODEL:-qwen2.5-0.5b}" ${tok:+--tokenizer "$tok"} \
        "$@" >"$out/profile_$name.log" 2>&1
    grep -v '^\[' "$out/profile_$name.log" | tail -40
}
profile memory_W2 70 --workload W2 --warmup 0 --steps 11 --memory --rows 30
# one round of each on the contract's defaults (--config contract); W2's result holds its peak GPU MiB
bench W1 $(($(left) * 2 / 5)) --workload W1
bench W2 $(($(left) - 50)) --workload W2
"$py" -c '
import json, sys
from pathlib import Path

KEYS = ("tokens_per_s", "s_per_step", "peak_gpu_mib", "peak_rss_mib", "final_loss", "median_step", "peak_rss")

def figures(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ("raw", "steps"):
                yield from figures(value, f"{prefix}{key}.")
    elif isinstance(node, (int, float)) and not isinstance(node, bool) and prefix[:-1].split(".")[-1] in KEYS:
        yield prefix[:-1], node

for name in ("W1", "W2"):
    path = Path(sys.argv[1]) / f"results_gpu_{name}.json"
    if not path.is_file():
        print(f"{name}: no result (see bench_{name}.log)")
        continue
    for key, value in figures(json.loads(path.read_text())):
        print(f"{name} {key} {value:.6g}")
' "$out" >>"$out/summary.txt" 2>&1
if (($(left) > 45)); then
    profile ops_W1 $(($(left) - 5)) --workload W1 --steps 4 --rows 25
fi
echo "== done in $SECONDS s" | tee -a "$out/summary.txt"
cat "$out/summary.txt"
