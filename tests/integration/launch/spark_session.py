"""A local SparkSession for the Spark tests: its Python workers run this interpreter and can import the
tests (the repository on their PYTHONPATH); stopped, with its py4j JVM, at the end."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from pyspark import SparkContext
from pyspark.sql import SparkSession

from tests.helpers import REPO, terminate


@contextlib.contextmanager
def local_spark(slots: int, app: str) -> Iterator[SparkSession]:
    """A local[``slots``] SparkSession named ``app``; the environment it changed is put back after."""
    names = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), saved["PYTHONPATH"]) if p)
    session = (SparkSession.builder.master(f"local[{slots}]").appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
               .config("spark.sql.shuffle.partitions", "4").config("spark.default.parallelism", str(slots))
               .getOrCreate())
    session.sparkContext.setLogLevel("FATAL")  # failures on purpose would print Java stack traces
    gateway = SparkContext._gateway
    try:
        yield session
    finally:
        session.stop()
        # stop() leaves the py4j JVM running for the rest of the session: stop and reap it too
        jvm = getattr(gateway, "proc", None)
        gateway.shutdown()
        SparkContext._gateway = SparkContext._jvm = None
        if jvm is not None:
            terminate(jvm, 30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
