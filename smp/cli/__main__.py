"""``python -m smp.cli``: the ``smp`` console script."""

import sys

from smp.cli import main

sys.exit(main())
