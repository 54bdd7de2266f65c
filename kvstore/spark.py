"""Train inside a Spark application (public face of :mod:`kvstore.launch.spark`).

Importing this module imports ``pyspark`` (the ``[spark]`` extra); ``import kvstore`` never does.
"""

from kvstore.launch.spark import NotEnoughSlotsError, SparkJobFailed, run

__all__ = ["run", "SparkJobFailed", "NotEnoughSlotsError"]
