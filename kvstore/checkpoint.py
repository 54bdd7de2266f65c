"""The file format for arrays and optimizer states (public face of :mod:`kvstore.core.checkpoint`).

``save_arrays`` / ``load_arrays`` for named arrays, ``read`` / ``write`` for a manifest with arrays,
``read_states`` / ``write_states`` for optimizer states ([formats.md](../docs/formats.md)).
"""

from kvstore.core.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    StateEntry,
    StatesFile,
    load_arrays,
    read,
    read_states,
    save_arrays,
    write,
    write_states,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "StateEntry", "StatesFile", "load_arrays", "read",
           "read_states", "save_arrays", "write", "write_states"]
