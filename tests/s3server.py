"""A real S3-compatible server (moto) on loopback for the s3:// tests, reached through the environment.

:func:`s3_server` starts moto's threaded server on 127.0.0.1 on a free port, sets fake credentials and
``AWS_ENDPOINT_URL`` (botocore reads it, so s3fs in this process and in every process a test starts
talks to the server), makes one bucket of its own, and yields the bucket's ``s3://`` URL.  moto keeps
its buckets per process, not per server: a second server in one test process (two modules under one
xdist worker) sees the first one's buckets, so each server makes a bucket of a new name.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator

import pytest

BUCKET = "kvstore-test"  # the prefix of each server's bucket name


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback with a new bucket ``kvstore-test-<hex>``; yields its ``s3://`` URL."""
    server_mod = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            s3fs.S3FileSystem.clear_instance_cache()  # none made for another server's endpoint
            bucket = f"{BUCKET}-{uuid.uuid4().hex[:12]}"
            s3fs.S3FileSystem().mkdir(bucket)
            yield f"s3://{bucket}"
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.stop()
