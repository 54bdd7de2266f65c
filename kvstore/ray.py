"""Run a kvstore cluster on Ray: every role an actor (public face of :mod:`kvstore.launch.ray`).

Importing this module imports ``ray`` (the ``[ray]`` extra); ``import kvstore`` never does.
"""

from kvstore.launch.ray import PlacementError, RayJob, RoleFailed, run, start

__all__ = ["run", "start", "RayJob", "PlacementError", "RoleFailed"]
