"""``python -m nantrace``: the same as the ``nantrace`` command."""

import sys

from .cli import main

sys.exit(main())
