"""``python -m twinkle.server [flags]``: the ``twinkle server`` command (``--config FILE`` reads
upstream's server_config.yaml); a bad setup is one ``error:`` line, as from ``twinkle server``."""

import sys

from twinkle.server.main import serve
from twinkle.utils.errors import UserError

if __name__ == "__main__":
    try:
        sys.exit(serve(sys.argv[1:]))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
