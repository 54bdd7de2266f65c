"""Unit tests guarding kvstore's public surface (__all__ and __version__)."""

from __future__ import annotations

import inspect
import re
import types

import kvstore
from kvstore import errors


def public_names(module: types.ModuleType) -> set[str]:
    """Names bound in ``module`` that do not start with '_' and are not submodules."""
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)}


def test_all_matches_the_public_names():
    """__all__ lists exactly the public (non-underscore, non-module) names plus __version__."""
    assert set(kvstore.__all__) == public_names(kvstore) | {"__version__"}


def test_all_has_no_duplicates():
    """No name appears twice in __all__."""
    assert len(kvstore.__all__) == len(set(kvstore.__all__))


def test_everything_in_all_exists():
    """Every name in __all__ is an attribute of kvstore."""
    missing = [name for name in kvstore.__all__ if not hasattr(kvstore, name)]
    assert missing == []


def test_star_import_gives_all():
    """`from kvstore import *` binds exactly the names in __all__."""
    namespace: dict = {}
    exec("from kvstore import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(kvstore.__all__)


def test_every_error_class_is_exported():
    """Every KVStoreError subclass defined in kvstore.errors is public in kvstore."""
    classes = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.KVStoreError)}
    assert {"KVStoreError", "ConfigError", "StoreClosedError"} <= classes
    assert classes <= set(kvstore.__all__)
    for name in classes:
        assert getattr(kvstore, name) is getattr(errors, name)


def test_core_api_is_exported():
    """create, KVStore and KNOWN_TYPES are public."""
    assert {"create", "KVStore", "KNOWN_TYPES"} <= set(kvstore.__all__)
    assert callable(kvstore.create)


def test_version_is_a_str():
    """__version__ is a non-empty version string like '0.1.0'."""
    assert isinstance(kvstore.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", kvstore.__version__)
