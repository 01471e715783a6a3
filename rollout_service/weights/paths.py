"""Which files a LoadWeights path may name: inside `security.weights_roots` (after following symlinks) and
regular files only. Everything here touches the filesystem, so callers run it in a worker thread
(`weights.service.WeightService.load`), never on the event loop."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc

from rollout_service.errors import Name, ServiceError, about_field, invalid, invalid_field

MAX_PATH_CHARS = 4096          # Linux PATH_MAX
LOAD = Name("LoadWeights")


def _bad_path(detail: str) -> ServiceError:
    """INVALID_ARGUMENT about LoadWeightsRequest.path: "LoadWeights: path <detail>"."""
    return invalid_field("path", detail, sep=" ", rpc="LoadWeights")


def resolve_roots(roots: list[str]) -> list[Path]:
    """The configured roots, symlinks followed (a root that does not exist yet still counts)."""
    return [Path(os.path.realpath(os.path.expanduser(r))) for r in roots]


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def denied(path: str, resolved: str, roots: list[Path]) -> ServiceError:
    via = "" if resolved == path else f" (resolves to {resolved!r})"
    return about_field(grpc.StatusCode.PERMISSION_DENIED, "path",
                       f"{path!r}{via} is outside security.weights_roots {[str(r) for r in roots]}; start the "
                       "server with --weights-root DIR (repeatable) or add DIR to security.weights_roots in its "
                       "config file to allow a directory", sep=" ", rpc="LoadWeights")


def check_path(path: str, roots: list[Path]) -> Path:
    """`path` resolved (symlinks followed), if it lies inside one of `roots`; else PERMISSION_DENIED.
    A malformed path (empty, NUL, too long) is INVALID_ARGUMENT."""
    if not path:
        raise _bad_path("is empty; give a safetensors file or a directory holding them")
    if "\0" in path:
        raise _bad_path("contains a NUL character")
    if len(path) > MAX_PATH_CHARS:
        raise _bad_path(f"is {len(path)} characters long; at most {MAX_PATH_CHARS}")
    if not os.path.isabs(path):
        raise _bad_path(f"{path!r} must be absolute (the server has its own working directory)")
    try:
        resolved = Path(os.path.realpath(path))
    except (OSError, ValueError) as e:        # a symlink loop, a component too long
        raise _bad_path(f"{path!r} cannot be resolved ({e})") from None
    if not _inside(resolved, roots):
        raise denied(path, str(resolved), roots)
    return resolved


def weight_files(path: str, roots: list[Path]) -> list[Path]:
    """The safetensors files `path` names (the file itself, or a directory's *.safetensors), each resolved,
    inside the roots and a regular file. Refusals name the offending file."""
    resolved = check_path(path, roots)
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise _bad_path(f"{path!r} does not exist on the server") from None
    except OSError as e:
        raise _bad_path(f"{path!r}: {e}") from None
    if stat.S_ISREG(st.st_mode):
        return [resolved]
    if not stat.S_ISDIR(st.st_mode):
        raise _bad_path(f"{path!r} is a {kind(st.st_mode)}, not a regular file or a directory")
    try:
        with os.scandir(resolved) as it:
            names = sorted(e.name for e in it if e.name.endswith(".safetensors"))
    except OSError as e:
        raise _bad_path(f"{path!r}: cannot list the directory ({e})") from None
    if not names:
        raise _bad_path(f"{path!r}: no .safetensors file in the directory")
    files = []
    for name in names:
        f = Path(os.path.realpath(resolved / name))
        if not _inside(f, roots):
            raise denied(str(resolved / name), str(f), roots)
        try:
            mode = os.stat(f).st_mode
        except OSError as e:
            raise invalid((LOAD, f": {str(resolved / name)!r}: {e}")) from None
        if not stat.S_ISREG(mode):
            raise invalid((LOAD, f": {str(resolved / name)!r} is a {kind(mode)}, not a regular file"))
        files.append(f)
    return files


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def open_regular(path: Path):
    """Open `path` for reading only if it is a regular file. O_NONBLOCK: a FIFO or device swapped in after
    the checks above cannot block the open; fstat then refuses it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is a {kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
