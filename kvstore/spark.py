"""Train inside a Spark application (public face of :mod:`kvstore.launch.spark`).

Importing this module imports ``pyspark`` (the ``[spark]`` extra); ``import kvstore`` never does.
"""

from kvstore.errors import NotEnoughSlotsError, SparkJobFailed
from kvstore.launch.spark import run

__all__ = ["run", "SparkJobFailed", "NotEnoughSlotsError"]
