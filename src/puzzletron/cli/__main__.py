"""``python -m puzzletron.cli``: the `puzzletron-data` command line."""

import sys

from puzzletron.cli import main

if __name__ == "__main__":
    sys.exit(main())
