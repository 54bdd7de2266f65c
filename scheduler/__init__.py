"""The kvstore scheduler: rendezvous, barriers and shutdown.  Run it with ``python -m scheduler``."""
