"""``python -m kvstore.scheduler``: run the scheduler (the launchers and ``kvstore.node`` start it so)."""

import sys

from .scheduler import main

sys.exit(main())
