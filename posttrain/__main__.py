"""``python -m posttrain ...`` (and ``torchrun ... -m posttrain ...``): the CLI."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
