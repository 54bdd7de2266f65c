"""Server snapshots on disk (public face of :mod:`kvstore.core.snapshot`, [formats.md](../docs/formats.md)).

``read(directory)`` gives the newest generation's values and optimizer states, as ``launch.py --resume``
reads them; ``write`` makes a new generation and names it in ``LATEST`` last.
"""

from kvstore.core.snapshot import POINTER, read, write

__all__ = ["POINTER", "read", "write"]
