"""Child of test_tensorboard's full-disk test: a ScalarWriter (no thread, no scheduler) writes POLLS
STATUS bodies (argv[2], default 20) under DIR (argv[1]) with its event files limited to LIMIT bytes
(argv[3]) by RLIMIT_FSIZE (SIGXFSZ ignored: a write past it fails with EFBIG, as on a full disk);
then the limit is lifted and one more body is written.  Prints the number of bodies written."""

import logging
import resource
import signal
import sys
import time

from kvstore import config as kvconfig
from kvstore.launch.tensorboard import ScalarWriter

logging.basicConfig(level=logging.DEBUG if "-v" in sys.argv else logging.INFO, stream=sys.stderr,
                    format="%(levelname)s %(name)s %(message)s")
run_dir, polls, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
writer = ScalarWriter(run_dir, kvconfig.load({}), "tcp://127.0.0.1:1")


def body(i: int) -> dict:
    """A STATUS reply with the scheduler's snapshot alone, its counters at ``i``."""
    return {"nodes": [], "scheduler": {"role": "scheduler", "rank": 0, "time": time.time(), "joins": i,
                                       "barriers": i, "losses": 0}}


written = sum(writer.record(body(i)) for i in range(polls))
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space again
written += writer.record(body(polls))
print(written)
