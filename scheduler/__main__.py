import sys

from scheduler.service import main

sys.exit(main())
