"""``python -m stalewise``: the same as the ``stalewise`` command."""

import sys

from stalewise.cli import main

if __name__ == "__main__":
    sys.exit(main())
