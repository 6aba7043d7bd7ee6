#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the bench (W1 and W2 on a Qwen2.5-0.5B-shaped model
# built from a config, bf16, the Trainer side with Liger when it is installed), the CUDA tests,
# Twinkle's W2 with the one-node LoRA MLP (--mlp torch), and more bench rounds while the time
# allows. Each step has its own time limit, so one that hangs does not take the others with it.
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

bench all 240 --workload all
echo "== CUDA tests ($(left) s left)"
timeout 100 "$py" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -30
if (($(left) > 90)); then  # the one-node LoRA MLP instead of Liger's SwiGLU: W2's GPU memory
    bench mlp_torch 80 --workload W2 --sides twinkle --mlp torch
fi
if (($(left) > 150)); then
    bench rounds $(($(left) - 10)) --workload all --rounds 2
fi
echo "== done in $SECONDS s"
