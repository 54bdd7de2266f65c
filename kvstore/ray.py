"""Run a kvstore cluster on Ray: every role an actor (public face of :mod:`kvstore.launch.ray`).

Importing this module imports ``ray`` (the ``[ray]`` extra); ``import kvstore`` never does.
"""

from kvstore.errors import PlacementError, RoleFailed
from kvstore.launch.ray import RayJob, run, start

__all__ = ["run", "start", "RayJob", "PlacementError", "RoleFailed"]
