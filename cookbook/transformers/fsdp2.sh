#!/usr/bin/env bash
# Train a self-cognition LoRA with the contract script.
#   bash cookbook/transformers/fsdp2.sh                      # one process (CPU or one GPU)
#   NPROC=2 bash cookbook/transformers/fsdp2.sh --fsdp-size 2 # FSDP2 over 2 processes via torchrun
# Extra flags go to the script (see: python cookbook/transformers/fsdp2.py --help).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-$here/../../.venv/bin/python}
NPROC=${NPROC:-1}
if [ "$NPROC" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" "$here/fsdp2.py" "$@"
fi
exec "$PY" "$here/fsdp2.py" "$@"
