"""``python -m cudakit``: the same as the ``cudakit`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
