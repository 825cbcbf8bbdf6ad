"""Small shared helpers: the user-facing error type, atomic writes, JSON metrics, and the
guarantees of a run's files: outputs probed before the work, one writer per directory, a
full disk reported as one line, content fingerprints."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any


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
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(err):
            raise disk_full_error(path, err) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(path) as handle:
        handle.write(data)


def read_settings(path: str | os.PathLike, what: str) -> Any:
    """A settings file read back: TOML for a ``.toml`` path, JSON otherwise; one error line,
    ``"{what} is not readable ({why})"``, for a file that is missing or malformed."""
    import tomllib
    path = Path(path)
    try:
        text = path.read_text()
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as err:
        raise SaffuError(f"{what} ({err})") from None


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


# --- outputs checked before the work -------------------------------------------------------

def probe_writable(path: str | os.PathLike, flag: str, directory: bool = False) -> None:
    """Fail before any work when ``path`` (the output of ``flag``: a file, or a ``directory``)
    cannot be written: the missing folders are created, a file is created and removed inside
    them, and the folders this made are removed again. Unlike ``os.access`` this also holds when
    running as root (``/proc``, read-only mounts, full disks)."""
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        if directory:
            raise SaffuError(f"cannot use {flag} {path}: it is a file; give a directory")
        raise SaffuError(f"cannot write {flag} {path}: it is a directory; give a file name such as "
                         f"{path / 'metrics.json'}")
    folder = path if directory else path.parent
    missing = []
    parent = folder
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise SaffuError(f"cannot write {flag} {path}: {parent} is a file, not a directory; choose another path")
    try:
        for created in reversed(missing):
            created.mkdir()
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".saffu-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = "the disk is full" if is_disk_full(err) else (err.strerror or str(err)).lower()
        raise SaffuError(f"cannot write {flag} {path}: {reason} ({err.filename or folder}); "
                         f"choose a writable location") from None
    finally:
        for created in missing:       # innermost first; they are made again when written
            with contextlib.suppress(OSError):
                created.rmdir()


# --- one writer per run or work directory --------------------------------------------------

LOCK_NAME = ".saffu.lock"


def command_line() -> str:
    """This process's command line, as a person would type it (for lock holders)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("saffu", "__main__.py")):
        argv[0] = "saffu"
    return " ".join(argv)[:300]


#: Lock files this process holds, by resolved directory: :func:`exclusive` is re-entrant.
_HELD: dict[Path, int] = {}


@contextlib.contextmanager
def exclusive(directory: str | os.PathLike, what: str | None = None) -> Iterator[Path]:
    """Hold the exclusive write lock of ``directory`` (created if missing) for the block: an
    ``fcntl.flock`` on ``directory/.saffu.lock``, which holds the holder's process id and
    command. A second writer gets one :class:`SaffuError` naming them; a lock left by a
    killed process never blocks (the kernel releases it with the process). Re-entrant within
    a process (the CLI holds it for a whole command, the trainer and the solvers' savers take
    it again). A directory this made that holds nothing but the lock at the end (a command
    refused before writing) is removed again. Yields the directory."""
    directory = Path(directory)
    made = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = directory.resolve()
        if key in _HELD:
            _HELD[key] += 1
            try:
                yield directory
            finally:
                _HELD[key] -= 1
            return
        handle = open(directory / LOCK_NAME, "a+")   # noqa: SIM115 (closed by the `with` below)
    except OSError as err:
        raise SaffuError(f"cannot write {directory}: {(err.strerror or str(err)).lower()}; "
                         f"choose a writable location") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise SaffuError(f"{directory} is in use by {holder}; wait for it to finish (or stop it) before "
                             f"writing into it, or use another directory") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} ({what or command_line()})\n")
        handle.flush()
        _HELD[key] = 1
        try:
            yield directory
        finally:
            del _HELD[key]
            if made and [p.name for p in directory.iterdir()] == [LOCK_NAME]:
                with contextlib.suppress(OSError):
                    (directory / LOCK_NAME).unlink()
                    directory.rmdir()
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- a full disk ---------------------------------------------------------------------------

def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (an ``OSError``, or the error of a checkpoint library that wraps one)
    says the file system is full or over quota."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return "No space left on device" in text or "RESOURCE_EXHAUSTED" in text or "Disk quota exceeded" in text


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this user on the file system holding ``path`` (or its nearest parent)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim``; a
    no-op elsewhere): after a large transient (a checkpoint restored, then compacted) the freed
    memory would otherwise stay in this process's resident set for the rest of a run."""
    import ctypes
    import ctypes.util
    import gc
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):        # not glibc: nothing to hand back this way
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def megabytes(nbytes: float) -> str:
    """``12,345,678`` bytes as ``11.8 MB``."""
    return f"{nbytes / 2**20:,.1f} MB"


def disk_full_error(path: str | os.PathLike, err: BaseException | None = None, needed: int | None = None,
                    then: str = "free space and rerun the same command") -> SaffuError:
    """The one-line error of a write to ``path`` that did not fit."""
    need = f"needs about {megabytes(needed)}, " if needed else ""
    return SaffuError(f"cannot write {path}: the disk is full ({need}{megabytes(free_bytes(path))} free); {then}")


def check_free(path: str | os.PathLike, needed: int, what: str, then: str = "free space or write elsewhere") -> None:
    """Refuse before writing ``needed`` bytes (``what``) under ``path`` when they cannot fit."""
    free = free_bytes(path)
    if needed > free:
        raise SaffuError(f"cannot write {what} to {path}: it needs about {megabytes(needed)} but "
                         f"{megabytes(free)} are free; {then}")


# --- fingerprints --------------------------------------------------------------------------

#: Hex digits kept of a sha256 fingerprint (64 bits: enough to tell inputs apart, short to read).
FINGERPRINT_DIGITS = 16


def file_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (the first :data:`FINGERPRINT_DIGITS` hex digits)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:FINGERPRINT_DIGITS]


def tree_fingerprint(tree: Any) -> str:
    """sha256 of a tree of arrays' content: every leaf's path, dtype, shape and bytes, in
    sorted path order, a path's keys read as text (so it does not depend on how the tree was
    stored or loaded: a checkpoint library may give back ``{"0": …}`` for ``{0: …}`` or a list)."""
    import jax
    import numpy as np
    digest = hashlib.sha256()
    name = lambda key: str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in sorted((("/".join(map(name, path)), leaf) for path, leaf in leaves), key=lambda pair: pair[0]):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{path}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:FINGERPRINT_DIGITS]
