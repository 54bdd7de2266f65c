"""``python -m kvstore.server``: run one server (the launchers and ``kvstore.node`` start it so)."""

import sys

from kvstore.server.server import main

sys.exit(main())
