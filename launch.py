#!/usr/bin/env python3
"""Start a kvstore cluster on this machine: ``python launch.py -n 4 -s 2 train.py ARGS``."""

import sys

from kvstore.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
