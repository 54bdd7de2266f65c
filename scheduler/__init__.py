"""The kvstore scheduler: rendezvous, barriers, liveness and shutdown.

This folder is installed as ``kvstore.scheduler`` and started by module name,
``python -m kvstore.scheduler`` (``python -m scheduler`` works from a checkout too); kvstore never
imports it.
"""
