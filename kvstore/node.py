"""``python -m kvstore.node CMD ARGS``: run this process's role, from ``DMLC_ROLE`` or a cluster manager.

The implementation is :mod:`kvstore.launch.node`; this module is the documented command.
"""

import sys

from kvstore.launch.node import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
