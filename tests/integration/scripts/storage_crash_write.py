"""Writer for the crash-while-writing test: a complete snapshot generation under URL, then a second
whose optimizer-state file stops half-sent (12 MiB of state, more than one S3 part, half written):
it prints "mid-write" and waits to be SIGKILLed.

argv: URL
"""

import signal
import sys

import numpy as np

from kvstore.core import checkpoint, snapshot

url = sys.argv[1]
N = 12 * 2**20 // 8
snapshot.write(url, {1: np.zeros(4)}, None)
real_write_states = checkpoint.write_states


def half_then_stop(fp, array, **kwargs):
    """Write half of the array's bytes, say so, and wait for the SIGKILL."""
    fp.write(array.tobytes()[: array.nbytes // 2])
    fp.flush()
    print("mid-write", flush=True)
    signal.pause()


def write_states(path, states):
    checkpoint.npy.write_array = half_then_stop  # the values file is written whole; this one is not
    real_write_states(path, states)


checkpoint.write_states = write_states
states = checkpoint.StatesFile(None, 1, [checkpoint.StateEntry(1, (N,), np.dtype(np.float64), 1,
                                                               {"mom": np.ones(N)})])
snapshot.write(url, {1: np.ones(N)}, states)
raise SystemExit("the write was not interrupted")
