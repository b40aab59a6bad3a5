"""``python -m tests.chaos``: see :mod:`tests.chaos.runner`."""

import sys

from tests.chaos.runner import main

sys.exit(main())
