"""Unit tests of kvstore.errors: the documented tree and the wire codes."""

from __future__ import annotations

import re

import pytest

from kvstore import errors as E

# The tree as drawn in the module docstring: class -> built-in parent (or None).
TREE = {
    "ConfigError": ValueError,
    "UnknownModeError": ValueError,
    "KeyNotInitializedError": KeyError,
    "DuplicateInitError": None,
    "ShapeMismatchError": ValueError,
    "DTypeMismatchError": ValueError,
    "KeyTypeError": TypeError,
    "DeadlineExceededError": TimeoutError,
    "StallError": TimeoutError,
    "NodeLostError": ConnectionError,
    "ProtocolError": None,
    "AuthenticationError": PermissionError,
    "IntegrityError": PermissionError,
    "RemoteError": None,
    "StoreClosedError": None,
    "OptimizerError": ValueError,
    "FormatError": ValueError,
    "UnsupportedError": NotImplementedError,
    "CollectiveMismatchError": ValueError,
    "TooFewWorkersError": None,
    "NotAMemberError": PermissionError,
}
BUILTINS = {ValueError, KeyError, TypeError, TimeoutError, ConnectionError, PermissionError,
            NotImplementedError}


def test_docstring_draws_exactly_the_tested_tree():
    """The module docstring's tree lists each class with the built-in parent this test expects."""
    drawn = dict(re.findall(r"\+-- (\w+)(?:\((\w+)\))?", E.__doc__))
    assert set(drawn) == set(TREE)
    for name, parent in TREE.items():
        assert drawn[name] == (parent.__name__ if parent else ""), name


@pytest.mark.parametrize("name", sorted(TREE))
def test_every_error_is_a_kvstore_error(name):
    """Every documented class exists, is an Exception and subclasses KVStoreError."""
    cls = getattr(E, name)
    assert issubclass(cls, E.KVStoreError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("name,parent", sorted(TREE.items()), ids=sorted(TREE))
def test_built_in_parents(name, parent):
    """Each class subclasses exactly the built-in named in the tree (and no other listed built-in)."""
    cls = getattr(E, name)
    assert {b for b in BUILTINS if issubclass(cls, b)} == ({parent} if parent else set())


def test_timeouts_and_lost_nodes_are_os_errors():
    """DeadlineExceededError and NodeLostError are OSErrors, as their built-in parents are."""
    assert issubclass(E.DeadlineExceededError, OSError)
    assert issubclass(E.NodeLostError, OSError)


def test_kvstore_error_is_the_root():
    """KVStoreError subclasses Exception directly."""
    assert E.KVStoreError.__bases__ == (Exception,)


def test_catching_by_built_in_works():
    """`except KeyError` catches a KeyNotInitializedError, `except TimeoutError` a deadline."""
    with pytest.raises(KeyError):
        raise E.KeyNotInitializedError("key 3 has not been initialised")
    with pytest.raises(TimeoutError):
        raise E.DeadlineExceededError("waited 5 s for the scheduler")


def test_key_not_initialized_str_has_no_quotes():
    """str(KeyNotInitializedError(msg)) is the sentence itself, not KeyError's quoted repr."""
    message = "key 'w' has not been initialised; call kv.init first"
    assert str(E.KeyNotInitializedError(message)) == message
    assert str(KeyError(message)) != message  # the built-in would have quoted it


def test_key_not_initialized_str_without_args_is_empty():
    """A KeyNotInitializedError without a message prints as an empty string."""
    assert str(E.KeyNotInitializedError()) == ""


def test_node_lost_error_attributes():
    """NodeLostError keeps its message and the lost node's role, rank and host."""
    exc = E.NodeLostError("server 1 went away", role="server", rank=1, host="10.0.0.2")
    assert str(exc) == "server 1 went away"
    assert (exc.role, exc.rank, exc.host) == ("server", 1, "10.0.0.2")


def test_node_lost_error_attributes_default_to_none():
    """NodeLostError built from a message alone has role, rank and host None."""
    exc = E.NodeLostError("gone")
    assert (exc.role, exc.rank, exc.host) == (None, None, None)


@pytest.mark.parametrize("name", sorted(TREE))
def test_error_code_round_trip(name):
    """error_code then error_from_code rebuilds the same class with the same message."""
    cls = getattr(E, name)
    code = E.error_code(cls("it broke"))
    assert code == name
    rebuilt = E.error_from_code(code, "it broke")
    assert type(rebuilt) is cls
    assert str(rebuilt) == "it broke"


@pytest.mark.parametrize("exc", [ValueError("x"), KeyError("x"), RuntimeError("x"), E.KVStoreError("x")],
                         ids=repr)
def test_error_code_of_foreign_exception_is_remote_error(exc):
    """Exceptions that are not one of the typed errors travel as RemoteError."""
    assert E.error_code(exc) == "RemoteError"


@pytest.mark.parametrize("code", ["NoSuchError", "", "KVStoreError", "ValueError", "error_code"])
def test_unknown_code_gives_remote_error(code):
    """An unknown (or untyped) wire code becomes a RemoteError carrying the message."""
    exc = E.error_from_code(code, "remote said no")
    assert type(exc) is E.RemoteError
    assert str(exc) == "remote said no"


def test_lost_node_travels_with_a_node_lost_error():
    """error_node and error_from_code carry a NodeLostError's role, rank and host over the wire."""
    exc = E.NodeLostError("server 1 is lost", role="server", rank=1, host="10.0.0.2")
    node = E.error_node(exc)
    assert node == ["server", 1, "10.0.0.2"]
    back = E.error_from_code(E.error_code(exc), str(exc), node)
    assert isinstance(back, E.NodeLostError)
    assert (back.role, back.rank, back.host) == ("server", 1, "10.0.0.2")
    assert E.error_node(E.NodeLostError("who knows")) is None and E.error_node(ValueError()) is None
    odd = E.error_from_code("NodeLostError", "m", ["server", "one", 3])
    assert (odd.role, odd.rank, odd.host) == ("server", None, None)
    assert type(E.error_from_code("ProtocolError", "m", ["server", 1, "h"])) is E.ProtocolError
