"""Small shared helpers: the user-facing error type, atomic writes and JSON metrics."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Mapping


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: Mode of every file saffu writes: readable (and writable) as the user's umask allows, like
#: ``open(path, "w")``, not the owner-only 0600 of a bare temporary file.
FILE_MODE = 0o666 & ~_umask()


class SaffuError(Exception):
    """An error caused by the user's input, reported by the CLI as one line (no traceback).

    The message says what went wrong, which file, and how to fix it.
    """


class SaffuWarning(UserWarning):
    """Something the user should look at that does not stop the work (the CLI prints it as
    one ``saffu: warning: …`` line)."""


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """``with atomic_open(path, "w") as handle: ...`` — writes go to a temporary file beside
    ``path`` that replaces it only when the block ends without error (and is removed
    otherwise), so readers never see a half-written file. The file gets the mode the umask
    gives any new file (:data:`FILE_MODE`). ``kwargs`` go to ``open``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise SaffuError(f"cannot write {path}: {err.strerror}; choose a writable location") from None
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(path) as handle:
        handle.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_metrics(path: str | os.PathLike | None, metrics: Mapping[str, Any]) -> None:
    """Write a flat JSON object of figures (numbers, strings, booleans) to ``path`` if given."""
    if path is None:
        return
    flat = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):  # numpy / jax scalars
            value = value.item()
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise TypeError(f"metric {key!r} is not a scalar: {type(value).__name__}")
        flat[key] = value
    atomic_write_json(path, flat)
