"""What ``bench/run.py`` runs: the two sides, the shared data and model set-up, the FLOP count.

The modules import each other by their plain names (each side also runs as a script), so
importing this package puts its folder on ``sys.path``."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
