"""``python -m multihead`` (and ``torchrun -m multihead``) runs the CLI."""

import sys

from multihead.cli import main

if __name__ == "__main__":
    sys.exit(main())
