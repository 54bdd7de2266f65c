"""The one owner of kvstore's persistent files: plain paths, ``file://`` and fsspec URLs.

Checkpoints, snapshots, optimizer-state files, the servers' shards and the workers' residual files
go through these functions and nothing else (a test scans the modules that own those files for a
bare ``open``).  A location is a plain path, a ``file://`` URL (the same path), or any URL fsspec
knows (``s3://``, ``gs://``, ``hdfs://``, ``memory://``...).  A plain path never imports fsspec;
another URL needs the ``kvstore-ps[storage]`` extra (fsspec, plus s3fs for ``s3://``, gcsfs for
``gs://``...) and raises :class:`~kvstore.errors.ConfigError` naming it when that is missing.

What each kind of store guarantees (docs/formats.md, "Storage URLs"):

- a local file system: a file is written to a temporary name beside its target, fsync'd and renamed
  over it; a folder (a snapshot generation) is written under a temporary name and renamed into place.
- other stores: a file is written to a temporary key beside its target and moved onto it (S3 and GCS:
  a server-side copy, so the target appears whole or not at all); folders cannot be renamed at once,
  so a generation is written in place and is complete only once the pointer naming it is written,
  last (:func:`renames_folders` says which a location gets).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import IO, Any

from kvstore.errors import ConfigError

__all__ = ["EXTRA", "absolute", "atomic_write", "exists", "is_local", "isdir", "join", "listdir",
           "local_path", "make_folder", "makedirs", "move", "open_append", "open_read", "parent",
           "read_text", "remove", "remove_tree", "rename_folder", "renames_folders", "rewrite_from",
           "temp_name"]

EXTRA = "kvstore-ps[storage]"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


def local_path(location: str | os.PathLike) -> str | None:
    """The local path ``location`` names (a plain path, or a ``file://`` URL's path), else None."""
    text = os.fspath(location)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match is None:
        return text
    if match.group(1).lower() in ("file", "local") and match.group(2) == "://":
        rest = text[match.end():]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        return rest
    return None


def is_local(location: str | os.PathLike) -> bool:
    """Whether ``location`` is on the local file system (a plain path or ``file://``)."""
    return local_path(location) is not None


def absolute(location: str | os.PathLike) -> str:
    """``location`` made independent of the working directory: a local one as an absolute path,
    a URL unchanged (what ``launch.py --resume`` hands its processes)."""
    path = local_path(location)
    return os.path.abspath(path) if path is not None else os.fspath(location)


def join(location: str | os.PathLike, *names: str) -> str:
    """``location`` with ``names`` appended (os.path.join locally, ``/`` in a URL)."""
    path = local_path(location)
    if path is not None:
        return os.path.join(path, *names)
    return "/".join([os.fspath(location).rstrip("/"), *names])


def parent(location: str | os.PathLike) -> str:
    """The folder ``location`` is in."""
    path = local_path(location)
    if path is not None:
        return os.path.dirname(path)
    return os.fspath(location).rstrip("/").rpartition("/")[0]


def temp_name(name: str) -> str:
    """A temporary name for ``name`` in its folder: hidden, unique to this process and call."""
    return f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _filesystem(location: str) -> tuple[Any, str]:
    """The fsspec file system and path of a URL.  Raises ConfigError when fsspec, or the package of
    the URL's protocol, is not installed, or the protocol is unknown."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{location!r} is a storage URL, which needs fsspec: pip install "
                          f"'{EXTRA}' (plus s3fs for s3://, gcsfs for gs://)") from None
    try:
        return fsspec.core.url_to_fs(location)
    except ImportError as exc:
        raise ConfigError(f"{location!r}: {exc} (pip install '{EXTRA}' installs fsspec and s3fs)") from None
    except ValueError as exc:
        raise ConfigError(f"{location!r} is not a storage URL fsspec knows: {exc}") from None


@contextlib.contextmanager
def _translated(location: str) -> Iterator[None]:
    """Around calls into a store: its non-OSError failures (a client library's own errors) raised as
    OSError naming ``location``.  Never around the caller's own code (a fill, a reader)."""
    try:
        yield
    except (OSError, ConfigError):
        raise
    except Exception as exc:  # botocore, aiohttp...: the store failed, which callers treat as I/O
        raise OSError(f"{location}: {type(exc).__name__}: {exc}") from exc


def _remote(location: str | os.PathLike) -> tuple[str, Any, str]:
    """(URL, fsspec file system, its path) of a URL; raises as :func:`_filesystem`."""
    url = os.fspath(location)
    fs, path = _filesystem(url)
    return url, fs, path


# -- files ----------------------------------------------------------------------------------------------

def atomic_write(location: str | os.PathLike, fill: Callable[[IO[bytes]], Any]) -> None:
    """Call ``fill(file)`` on a fresh temporary file beside ``location``, then move it onto ``location``.

    On any failure the temporary file is removed and what was at ``location`` is left as it was.
    Raises OSError from the store, ConfigError for a URL kvstore cannot open (see the module), and
    whatever ``fill`` raises."""
    path = local_path(location)
    if path is not None:
        _local_atomic_write(path, fill)
        return
    url, fs, target = _remote(location)
    head, _, name = target.rstrip("/").rpartition("/")
    temp = f"{head}/{temp_name(name)}"
    try:
        with _translated(url):
            f = fs.open(temp, "wb")
        try:
            fill(f)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()  # the partial temporary is removed below
            raise
        with _translated(url):
            f.close()
            fs.mv(temp, target)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(temp)
        raise


def _local_atomic_write(target: str, fill: Callable[[IO[bytes]], Any]) -> None:
    directory, name = os.path.split(os.path.abspath(target))
    temp = os.path.join(directory, temp_name(name))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a rename in local ``directory`` durable where the platform allows it (POSIX); best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_read(location: str | os.PathLike) -> Iterator[IO[bytes]]:
    """``location`` opened for reading bytes (seekable).  Raises FileNotFoundError when it does not
    exist, OSError from the store, ConfigError for a URL kvstore cannot open."""
    path = local_path(location)
    if path is not None:
        with open(path, "rb") as f:
            yield f
        return
    url, fs, target = _remote(location)
    with _translated(url):
        f = fs.open(target, "rb")
    with f:
        yield f


def read_text(location: str | os.PathLike) -> str:
    """The UTF-8 text of ``location`` (UnicodeDecodeError when it is not; errors of :func:`open_read`)."""
    with open_read(location) as f:
        return f.read().decode("utf-8")


def exists(location: str | os.PathLike) -> bool:
    """Whether a file (or folder) is at ``location`` now (a URL is asked afresh, not from a cache)."""
    return _asked(location, os.path.exists, "exists")


def isdir(location: str | os.PathLike) -> bool:
    """Whether ``location`` is a folder (in an object store: a prefix some object has)."""
    return _asked(location, os.path.isdir, "isdir")


def _asked(location: str | os.PathLike, local: Callable[[str], bool], question: str) -> bool:
    """``local(path)`` for a local ``location``, else the store's method ``question``, asked afresh."""
    path = local_path(location)
    if path is not None:
        return local(path)
    url, fs, target = _remote(location)
    with _translated(url):
        fs.invalidate_cache(target)
        return bool(getattr(fs, question)(target))


def listdir(location: str | os.PathLike) -> list[str]:
    """The names in folder ``location``, asked afresh.  Raises FileNotFoundError when there is none
    (an object store: no object under it), OSError from the store."""
    path = local_path(location)
    if path is not None:
        return os.listdir(path)
    url, fs, target = _remote(location)
    with _translated(url):
        fs.invalidate_cache(target)
        entries = fs.ls(target, detail=False)
        return [str(entry).rstrip("/").rpartition("/")[2] for entry in entries]


def makedirs(location: str | os.PathLike) -> None:
    """Make folder ``location`` and its parents (an object store needs none: nothing to do there
    beyond what fsspec does).  Raises OSError."""
    path = local_path(location)
    if path is not None:
        os.makedirs(path, exist_ok=True)
        return
    url, fs, target = _remote(location)
    with _translated(url):
        fs.makedirs(target, exist_ok=True)


def remove(location: str | os.PathLike) -> None:
    """Remove the file at ``location``.  Raises FileNotFoundError or another OSError."""
    path = local_path(location)
    if path is not None:
        os.unlink(path)
        return
    url, fs, target = _remote(location)
    with _translated(url):
        fs.rm(target)


def move(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move the file ``source`` onto ``target`` (both on one store; locally ``os.replace``).  Raises
    FileNotFoundError or another OSError."""
    path, dest = local_path(source), local_path(target)
    if path is not None and dest is not None:
        os.replace(path, dest)
        return
    url, fs, src = _remote(source)
    _, _, dst = _remote(target)
    with _translated(url):
        fs.mv(src, dst)


def open_append(location: str | os.PathLike) -> io.FileIO:
    """The local file ``location`` opened to append bytes, unbuffered (created if missing): a file a
    writer keeps open and grows (a TensorBoard event file).  Only a local file can (ValueError for a
    URL: an object store is written whole); raises OSError."""
    path = local_path(location)
    if path is None:
        raise ValueError(f"{location}: only a local file can be appended to")
    return open(path, "ab", buffering=0)  # noqa: SIM115 - the caller holds and closes it


def rewrite_from(location: str | os.PathLike, offset: int, data: bytes) -> None:
    """Write ``data`` into the local file ``location`` at ``offset`` and end the file there: an append
    that also replaces the file's last bytes (a timeline part's closing line).  Only a local file can
    (ValueError for a URL: an object store is written whole); raises OSError."""
    path = local_path(location)
    if path is None:
        raise ValueError(f"{location}: only a local file can be written in place")
    with open(path, "r+b") as out:
        out.seek(offset)
        out.write(data)
        out.truncate()


def remove_tree(location: str | os.PathLike) -> None:
    """Remove folder ``location`` and everything under it, best effort (errors are ignored)."""
    path = local_path(location)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        return
    url, fs, target = _remote(location)
    with contextlib.suppress(Exception):
        fs.rm(target, recursive=True)


# -- folders --------------------------------------------------------------------------------------------

def renames_folders(location: str | os.PathLike) -> bool:
    """Whether a folder under ``location`` can be renamed into place at once (the local file system);
    elsewhere a generation is written in place and committed by the pointer written after it."""
    return is_local(location)


def make_folder(location: str | os.PathLike) -> None:
    """Make the new local folder ``location`` (FileExistsError when it exists): see
    :func:`renames_folders`."""
    path = local_path(location)
    if path is None:
        raise ValueError(f"{location}: only a local folder can be made and renamed into place")
    os.mkdir(path)


def rename_folder(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Flush local folder ``source`` and rename it to ``target`` durably (both local).  Raises OSError."""
    src, dst = local_path(source), local_path(target)
    if src is None or dst is None:
        raise ValueError(f"{source} -> {target}: only local folders are renamed")
    fsync_directory(src)
    os.rename(src, dst)
    fsync_directory(os.path.dirname(os.path.abspath(dst)))
