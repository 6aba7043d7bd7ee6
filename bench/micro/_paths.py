"""Imported first by every micro-benchmark: puts ``bench/`` (for ``run``) and ``bench/harness/``
on ``sys.path``."""

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1]
for _folder in (_BENCH, _BENCH / "harness"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
