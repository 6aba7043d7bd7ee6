#!/usr/bin/env bash
# Prepare, on a machine with a package registry, what a GPU machine without network needs for
# scripts/gpu_check.sh, in two ignored folders that the device tool carries:
#   .whl/      wheels of the libraries its image lacks (the H200 image had torch with CUDA,
#              triton, numpy, tokenizers, safetensors, huggingface_hub, accelerate, pyarrow,
#              pandas), at the versions of this .venv; liger-kernel for the Trainer side;
#              where this .venv has them, gguf, pytest (with iniconfig and pluggy) and
#              matplotlib with its dependencies. .whl/names.txt lists every package fetched
#   .gpu/tok   SmolLM2's tokenizer files, so W2's long rows are sized without the bundled GGUF
# Then, on the GPU machine (device tool: carry [".whl", ".gpu"]):
#   python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --target /tmp/site \
#       $(cat .whl/names.txt) &&
#   export PYTHONPATH=/tmp/site:$PWD/src && scripts/gpu_check.sh $OUT .gpu/tok 540
# Liger is installed there too; tests/gpu hides it in-process to test the torch-only chain.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl .gpu
mkdir -p .whl .gpu/tok
"$py" -m pip download -q --no-deps --only-binary=:all: -d .whl \
    "transformers==$(version transformers)" "peft==$(version peft)" "datasets==$(version datasets)" \
    "dill==$(version dill)" "liger-kernel==${LIGER_VERSION:-0.8.5}"
# These two have wheels per Python version; the GPU machine's may differ from this one's.
for v in 3.10 3.11 3.12 3.13; do
    "$py" -m pip download -q --no-deps --only-binary=:all: -d .whl --python-version "$v" \
        --platform manylinux2014_x86_64 "multiprocess==$(version multiprocess)" "xxhash==$(version xxhash)"
done
names="transformers peft datasets dill multiprocess xxhash liger-kernel"
# Optional: only where this .venv has them (a wheel per Python version where it has native code).
# matplotlib draws curves.png at a run's end (without it a warning, no figure); tensorboard is
# only for --report-to tensorboard, which the GPU checks never ask, so its many wheels stay out.
for name in gguf pytest iniconfig pluggy matplotlib contourpy cycler fonttools kiwisolver pillow \
    pyparsing python-dateutil six; do
    "$py" -c "import importlib.metadata as m; m.version('$name')" 2>/dev/null || continue
    for v in 3.10 3.11 3.12 3.13; do
        "$py" -m pip download -q --no-deps --only-binary=:all: -d .whl --python-version "$v" \
            --platform manylinux2014_x86_64 "$name==$(version "$name")" || echo "no $name wheel for Python $v"
    done
    names="$names $name"
done
echo "$names" >.whl/names.txt
folder=$("$py" -c "from twinkle.hub.model import resolve_model; print(resolve_model(None))")
cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja .gpu/tok/
du -sh .whl .gpu
ls .whl .gpu/tok
