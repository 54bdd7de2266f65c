"""``python -m kvstore.scheduler``: run the scheduler (the launchers and ``kvstore.node`` start it so)."""

import sys

from .process import main

sys.exit(main())
