"""``python -m keras_dtensor_mixfix`` entry point."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
