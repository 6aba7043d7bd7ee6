#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the CUDA tests, what is alive at W2's peak of GPU
# memory (bench/micro/profile_step.py --memory), the bench (W1 and W2 on a Qwen2.5-0.5B-shaped model
# built from a config, bf16, the Trainer side with Liger when it is installed; two rounds when
# the time allows), then a profile of W1's ops. Each step has its own time limit, so one that
# hangs does not take the others with it.
#
#   scripts/gpu_check.sh OUT_DIR [TOKENIZER_DIR] [SECONDS]
#
# TOKENIZER_DIR: a folder of tokenizer files, for a machine without the bundled GGUF (bench/README.md).
# SECONDS: the whole run's budget (default 540). PYTHON: the interpreter (default python3); MODEL:
# the bench model (default qwen2.5-0.5b; tiny to try the script on a CPU).
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

echo "== CUDA tests ($(left) s left)"
timeout 100 "$py" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -30
profile() { # profile NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    echo "== profile $name ($limit s at most): $*"
    timeout "$limit" "$py" bench/micro/profile_step.py --model "${MODEL:-qwen2.5-0.5b}" ${tok:+--tokenizer "$tok"} \
        "$@" >"$out/profile_$name.log" 2>&1
    grep -v '^\[' "$out/profile_$name.log" | tail -40
}
profile memory_W2 80 --workload W2 --warmup 0 --steps 11 --memory --rows 30
if (($(left) > 270)); then
    bench all $(($(left) - 40)) --workload all --rounds 2
else
    bench all $(($(left) - 10)) --workload all
fi
if (($(left) > 45)); then
    profile ops_W1 $(($(left) - 5)) --workload W1 --steps 4 --rows 25
fi
echo "== done in $SECONDS s"
