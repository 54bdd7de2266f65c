"""Packaging for the kvstore parameter server: one import name, ``kvstore``.

The repository's top-level ``scheduler/`` folder is installed as ``kvstore.scheduler`` (started as
``python -m kvstore.scheduler``), so the distribution claims no generic top-level name; ``launch.py``
stays a script of the checkout (the installed command is ``kvstore-launch``).

``kvstore.net._hot`` (kvstore/net/_hot.c: the compact layout's framing, MAC and encoding in C, issue 39)
is built here from the package's own source, optionally: where no C compiler or no Python headers are
found the build warns and goes on, and the package runs its pure-Python path (kvstore/net/native.py).
"""

import re
from pathlib import Path

from setuptools import Extension, find_packages, setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "kvstore" / "__init__.py").read_text()).group(1)

setup(
    name="kvstore-ps",  # "kvstore" is taken on PyPI; the import name is still kvstore
    version=version,
    description="Apache MXNet's distributed KVStore (parameter server) for PyTorch and NumPy",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kvstore", "kvstore.*"]),  # kvstore/scheduler links to scheduler/
    package_data={"kvstore": ["py.typed"]},  # PEP 561: the package's type hints are for its users too
    # optional: a failed compile (no gcc, no Python.h) is a warning, and kvstore.net.native falls back
    ext_modules=[Extension("kvstore.net._hot", ["kvstore/net/_hot.c"], optional=True,
                           extra_compile_args=["-O2"])],
    license="Apache-2.0",
    license_files=["LICENSE"],  # the Apache License 2.0 text, in the sdist and the wheel's metadata
    install_requires=["numpy>=1.24", "pyzmq>=26", "msgpack>=1.0"],
    extras_require={
        "torch": ["torch>=2.1"],
        "bfloat16": ["ml_dtypes>=0.3"],  # numpy bfloat16 values (ml_dtypes.bfloat16 arrays)
        "ray": ["ray>=2.9"],  # launch.py --launcher ray, kvstore.ray
        "spark": ["pyspark>=3.5"],  # kvstore.spark (needs Java 17 on the machine)
        "tensorboard": ["tensorboard>=2.14"],  # launch.py --tensorboard, kvstore.spark.run(tensorboard=)
        "storage": ["fsspec>=2023.1", "s3fs>=2023.1"],  # storage URLs (s3://, memory://): core/storage.py
    },
    entry_points={"console_scripts": ["kvstore-launch=kvstore.launch.cli:main",
                                      "kvstore-node=kvstore.node:main",
                                      "kvstore-status=kvstore.status:main"]},
    classifiers=["Programming Language :: Python :: 3"],  # the license: license= above
)
