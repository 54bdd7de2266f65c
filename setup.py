"""Packaging for the kvstore parameter server (import names ``kvstore`` and ``scheduler``)."""

import re
from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "kvstore" / "__init__.py").read_text()).group(1)

setup(
    name="kvstore-ps",  # "kvstore" is taken on PyPI; the import name is still kvstore
    version=version,
    description="Apache MXNet's distributed KVStore (parameter server) for PyTorch and NumPy",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["kvstore", "scheduler"],
    py_modules=["launch"],
    install_requires=["numpy>=1.24", "pyzmq>=26", "msgpack>=1.0"],
    extras_require={
        "torch": ["torch>=2.1"],
        "ray": ["ray>=2.9"],  # launch.py --launcher ray, kvstore.ray
        "spark": ["pyspark>=3.5"],  # kvstore.spark (needs Java 17 on the machine)
    },
    entry_points={"console_scripts": ["kvstore-launch=kvstore.launcher:main"]},
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
