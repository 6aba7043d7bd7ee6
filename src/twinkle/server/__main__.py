"""``python -m twinkle.server [flags]``: the ``twinkle server`` command (``--config FILE`` reads
upstream's server_config.yaml)."""

import sys

from twinkle.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["server", *sys.argv[1:]]))
