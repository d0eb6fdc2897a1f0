"""Files Headroom writes, and files it reads back (which it does not trust).

Untrusted: everything read back from ComfyUI's output/, input/ and models/ folders. Any HTTP client of a
ComfyUI server can upload files into output/ and input/ (stock `POST /upload/image`), so a pointer file there
(a run's latest.json, a cache manifest) may name any path, and a dataset folder may hold symlinks to system
files. So: a path read from a file must be a plain relative path, and resolved (symlinks too) it must lie inside
the folder it belongs to (`path_in`, `resolve_inside`); files of our own are read only when they are regular
files, not symlinks (`open_regular`); JSON parses strictly, without NaN / Infinity (`read_json`).

Writes are atomic: a temp file (or folder) next to the target, fsynced, given the modes the umask asks for
(mkstemp's 0600 / mkdtemp's 0700 otherwise stay), then renamed into place. Temp names carry the writer's pid
(`.<name>.hrtmp-<pid>-<random>`), so the next open of a folder removes what a killed writer left (`prune_temp`).
A write that fails for lack of space raises one `DiskFullError` that says what was being written, where, how much
it needs and how much is free; the temp is removed and every file written before is as it was. A large write
(`ROOM_CHECKED_BYTES`) that the free space cannot hold says so before it starts (`check_room`).

User-facing messages name paths relative to ComfyUI's folders ("output/headroom_runs/x"), never absolute
server paths: the nodes register those folders (`register_display_root`), as this package imports nothing
from ComfyUI.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import os_compat, public_module

TEMP_MARK = ".hrtmp-"
_TEMP = re.compile(r"\..+\.hrtmp-(\d+)-[0-9a-f]+(?:\.tmp)?")
# Temp names of earlier versions (no pid): checkpoint folders, moved-aside copies, mkstemp files, cache shards.
_LEGACY_TEMP = re.compile(r"\.(?:step_\d{8}\..+|stale-.+|shard-.+\.tmp|manifest-.+\.tmp|probe-.+|.+\.tmp)")
STALE_TEMP_SECONDS = 3600  # a temp of a live process this old is a leftover too (pids are reused)
JSON_MAX_BYTES = 256 << 20
# Writes of at least this many bytes ask the disk's free space first: one that cannot fit fails at once, not after
# minutes of writing (a full fine-tune's checkpoint is tens of GB) that fill a disk other programs use too. Smaller
# ones just write (a compressing file system may hold what its free space says it cannot).
ROOM_CHECKED_BYTES = 64 << 20


class UntrustedFileError(ValueError):
    """A file read back from ComfyUI's folders failed a check (outside its folder, a symlink, malformed)."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


class WriteError(RuntimeError):
    """A file could not be written; the message names it (relative to ComfyUI's folders) and the fix."""

    __module__ = public_module(__name__)


class DiskFullError(WriteError):
    """The disk ran out of space: what was being written, where, how much it needs and how much is free."""

    __module__ = public_module(__name__)


# --- paths in messages ---------------------------------------------------------------------------------------
_display_roots: dict[str, str] = {}  # absolute root -> label
_display_providers: list[Callable[[], Iterable[tuple[str, str]]]] = []


def register_display_root(label: str, path: str | os.PathLike) -> None:
    """Messages show paths under `path` as `label/...`."""
    for form in (os.path.abspath(path), os.path.realpath(path)):
        _display_roots[form] = label


def register_display_roots(provider: Callable[[], Iterable[tuple[str, str]]]) -> None:
    """`provider()` gives (label, folder) pairs when a message is made (the nodes give ComfyUI's folders, which
    ComfyUI may move at start-up)."""
    if provider not in _display_providers:
        _display_providers.append(provider)


def _roots() -> dict[str, str]:
    roots = {}
    for provider in _display_providers:
        try:
            for label, path in provider():
                for form in (os.path.abspath(path), os.path.realpath(path)):
                    roots.setdefault(form, label)
        except Exception:  # naming a path must never fail a message
            continue
    roots.update(_display_roots)
    return roots


def display_path(path: str | os.PathLike) -> str:
    """`path` relative to the nearest registered ComfyUI folder ("output/headroom_runs/x"); otherwise only its
    last two parts: a user-facing message never shows an absolute server path."""
    absolute = os.path.abspath(path)
    best = None
    roots = _roots()
    for candidate in (absolute, os.path.realpath(absolute)):
        for root, label in roots.items():
            if candidate == root or candidate.startswith(root.rstrip(os.sep) + os.sep):
                if best is None or len(root) > best[0]:
                    relative = os.path.relpath(candidate, root)
                    best = (len(root), label if relative == "." else f"{label}/{relative}")
    if best is not None:
        return best[1].replace(os.sep, "/")
    return ".../" + "/".join(Path(absolute).parts[-2:])


def relative_text(text: str) -> str:
    """`text` (e.g. a library's error message) with the registered ComfyUI folders written as their labels."""
    for root, label in sorted(_roots().items(), key=lambda item: -len(item[0])):
        text = text.replace(root.rstrip(os.sep) + os.sep, label + "/").replace(root, label)
    return text


# --- untrusted paths -----------------------------------------------------------------------------------------
def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether the real path of `path` is `root` or inside it (both resolved, symlinks included)."""
    return _real_within(os.path.realpath(path), root)


def _real_within(real: str, root: str | os.PathLike) -> bool:
    base = os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def resolve_inside(path: str | os.PathLike, roots: Iterable[str | os.PathLike], what: str) -> Path:
    """The real path of `path` when it lies inside one of `roots`; otherwise an UntrustedFileError. The path is
    resolved once (every image of a dataset passes here each time it is opened; realpath is slow on Windows)."""
    roots = list(roots)
    real = os.path.realpath(path)
    if any(_real_within(real, root) for root in roots):
        return Path(real)
    where = " or ".join(display_path(root) for root in roots)
    raise UntrustedFileError(f"{what} {display_path(path)} leads outside {where} (a symlink?): refused")


def path_in(base: str | os.PathLike, relative: Any, what: str, pattern: re.Pattern | None = None) -> Path:
    """A path named inside a file (untrusted) -> its real path inside `base`. It must be a plain relative path of
    '/'-separated names (no '..', no absolute or Windows paths), full-match `pattern` when given, and lead
    nowhere outside `base` once symlinks are resolved."""
    if (not isinstance(relative, str) or not relative or "\x00" in relative or "\\" in relative
            or os.path.isabs(relative) or any(part in ("", ".", "..") for part in relative.split("/"))
            or (pattern is not None and not pattern.fullmatch(relative))):
        raise UntrustedFileError(f"{what}: {str(relative)[:80]!r} is not a file name inside {display_path(base)}: refused")
    return resolve_inside(Path(base) / relative, [base], what)


def open_regular(path: str | os.PathLike, what: str, max_bytes: int | None = None):
    """Open a file of ours for reading: it must be a regular file, not a symlink (nor a FIFO or device, which
    would block or never end), and at most `max_bytes` long."""
    try:
        fd = os_compat.open_no_follow(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UntrustedFileError(f"{what} {display_path(path)} is a symlink: refused") from None
        raise UntrustedFileError(f"{what} {display_path(path)} cannot be read ({error.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UntrustedFileError(f"{what} {display_path(path)} is not a regular file: refused")
    if max_bytes is not None and info.st_size > max_bytes:
        os.close(fd)
        raise UntrustedFileError(f"{what} {display_path(path)} is {info.st_size} bytes, more than the "
                                 f"{max_bytes} such a file can be: refused")
    return os.fdopen(fd, "rb")


def no_json_constants(name: str):
    """json.loads' parse_constant: NaN / Infinity refused (Python's json reads them, JSON has none)."""
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: str | os.PathLike, what: str, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """A JSON file of ours, parsed strictly (no NaN / Infinity); anything wrong is an UntrustedFileError."""
    with open_regular(path, what, max_bytes) as handle:
        data = handle.read()
    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_json_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise UntrustedFileError(f"{what} {display_path(path)} is not valid JSON ({error})") from None


# --- modes -----------------------------------------------------------------------------------------------------
def file_mode() -> int:
    return 0o666 & ~os_compat.current_umask()


def dir_mode() -> int:
    return 0o777 & ~os_compat.current_umask()


# --- temp files and their leftovers ------------------------------------------------------------------------------
def _new_file(path: Path) -> None:
    """Create `path` empty and exclusively: every file Headroom writes starts here (and tests inject faults here)."""
    os_compat.create_new_file(path)


def temp_name(name: str) -> str:
    return f".{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def prune_temp(folder: str | os.PathLike) -> list[str]:
    """Remove the temp files and folders killed writers left in `folder`: ours whose writer process is gone
    (or that are older than an hour), and pid-less ones of earlier versions older than an hour. Returns their
    names. Temps of live writers (another ComfyUI sharing a cache folder) are left alone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = _TEMP.fullmatch(entry.name)
        if match is None and not _LEGACY_TEMP.fullmatch(entry.name):
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
        except OSError:
            continue
        if match is not None:
            pid = int(match.group(1))
            if pid == os.getpid() or (os_compat.process_alive(pid) and not old):
                continue
        elif not old:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass
    return removed


# --- writing ---------------------------------------------------------------------------------------------------
def format_bytes(count: float, largest: str = "TiB") -> str:
    """A byte count as "512 B" / "1.5 MiB", up to the `largest` unit (KiB, MiB, GiB or TiB). Memory reports use
    memory_stats.format_bytes (two decimals for GiB, thousands separators, "n/a")."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == largest:
            return f"{count:.1f} {unit}"


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk of `path`, or of its nearest folder that exists (None: none can be asked, or a file
    system that says nothing: some network and FUSE mounts report a size and free space of 0)."""
    for folder in (path, *path.parents):
        try:
            usage = shutil.disk_usage(folder)
        except OSError:
            continue
        return usage.free if usage.total else None
    return None


def check_room(path: Path, at_least: int, what: str, needed: int | None = None) -> None:
    """Before writing `what` to `path`: a DiskFullError, as a write that met the full disk says it, where the
    `at_least` bytes the write takes at the least (its tensors) are more than the disk has free. Writes under
    ROOM_CHECKED_BYTES are not checked."""
    if at_least < ROOM_CHECKED_BYTES:
        return
    free = free_bytes(Path(path).parent)
    if free is not None and free < at_least:
        raise write_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), what, path, needed or at_least)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC / EDQUOT, also as the text of libraries that do not raise OSError (safetensors' Rust writer says
    "No space left on device (os error 28)")."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def write_error(error: BaseException, what: str, path: Path, needed: int | None) -> Exception | None:
    """The clear error for a failed write of `what` to `path` (None: not a file-system problem; raise it as is)."""
    where = display_path(path)
    if is_disk_full(error):
        free = free_bytes(Path(path).parent)
        need = f"it needs about {format_bytes(needed)}" if needed is not None else "it needs more room"
        has = f", {format_bytes(free)} is free there" if free is not None else ""
        return DiskFullError(
            f"disk full: {what} could not be written to {where} ({need}{has}). Free space on that disk, or move "
            "the folder to a disk with room, then queue again; everything written before is kept as it was."
        )
    if isinstance(error, (os_compat.FileInUseError, os_compat.ReadOnlyFileError)):
        return WriteError(f"{what} could not be written to {where}: {error.strerror}; everything written before is kept "
                          "as it was.")
    if isinstance(error, OSError):
        reason = error.strerror or str(error)
        return WriteError(f"{what} could not be written to {where} ({reason}); make that folder writable, or move "
                          "it, then queue again; everything written before is kept as it was.")
    return None


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None], what: str, needed: int | None = None,
                 make_parents: bool = True, at_least: int = 0) -> None:
    """Write `path` through `write(temp path)` into a temp file beside it, then rename it into place. Any failure
    removes the temp and leaves the old `path` (if any) as it was; a file-system failure becomes a WriteError
    (DiskFullError when out of space, before writing where the write takes `at_least` bytes and the disk has not
    that much free: check_room) naming `what`."""
    path = Path(path)
    temp = None
    check_room(path, at_least, what, needed)  # before anything is made
    try:
        problem = os_compat.path_length_problem(path.parent, len(temp_name(path.name) + ".tmp"))
        if problem:
            raise WriteError(f"{what} cannot be written to {display_path(path)}: {problem}; everything written "
                             "before is kept as it was.")
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / (temp_name(path.name) + ".tmp")
        _new_file(temp)
        write(temp)
        os_compat.fsync_file(temp)
        os.chmod(temp, file_mode())
        os_compat.replace(temp, path, what)
        temp = None
        os_compat.fsync_folder(path.parent)
    except Exception as error:
        if temp is not None:
            _unlink_quietly(temp)
        clear = write_error(error, what, path, needed)
        if clear is None:
            raise
        raise clear from error
    except BaseException:
        if temp is not None:
            _unlink_quietly(temp)
        raise


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_bytes_to(data: bytes) -> Callable[[Path], None]:
    def write(target: Path) -> None:
        with open(target, "wb") as handle:
            handle.write(data)
    return write


def write_bytes(path: str | os.PathLike, data: bytes, what: str, make_parents: bool = True) -> None:
    write_atomic(path, _write_bytes_to(data), what, len(data), make_parents, len(data))


def write_json(path: str | os.PathLike, value: Any, what: str, make_parents: bool = True) -> None:
    """Strict JSON (a NaN or infinity is refused, never written), atomically."""
    write_bytes(path, json.dumps(value, indent=2, sort_keys=True, allow_nan=False).encode(), what, make_parents)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in nested dicts / lists: what a save of them needs on disk (about)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


# safetensors' dtype names, in the order its writer lays tensors out (larger elements first, so every tensor
# starts aligned to its element size).
_SAFETENSORS_DTYPES = ("uint64:U64 int64:I64 float64:F64 complex64:C64 float32:F32 uint32:U32 int32:I32 bfloat16:BF16 "
                       "float16:F16 uint16:U16 int16:I16 float8_e4m3fn:F8_E4M3 float8_e5m2:F8_E5M2 int8:I8 uint8:U8 "
                       "bool:BOOL").split()


def write_safetensors(target: Path, tensors: dict, metadata: dict[str, str] | None = None,
                      drop_cached: bool = False) -> None:
    """A safetensors file streamed through a Python file object, byte for byte what safetensors.torch.save makes.

    Written here because the library can only write by path, into a temp file of its own (a kill leaves an
    anonymous `.tmpXXXXXX`, and a full disk comes back as text), or return the whole file as bytes (a second copy
    of e.g. a ControlNet's weights in RAM). Through a Python file a full disk is an OSError(ENOSPC), and tensors
    are copied off the device one at a time. tests/comfy/test_reliability.py compares the bytes with the library's."""
    import torch

    kinds = {getattr(torch, entry.split(":")[0], None): (rank, entry.split(":")[1])
             for rank, entry in enumerate(_SAFETENSORS_DTYPES)}
    if any(tensor.dtype not in kinds for tensor in tensors.values()):  # a dtype this list lacks: the library's bytes
        from safetensors.torch import save

        data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)
        with os_compat.open_to_write(target, drop_cached) as handle:
            handle.write(data)
        return
    order = sorted(tensors, key=lambda name: (kinds[tensors[name].dtype][0], name))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": kinds[tensor.dtype][1], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with os_compat.open_to_write(target, drop_cached) as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for name in order:
            tensor = tensors[name].detach().to("cpu").contiguous()
            if tensor.numel():
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def write_torch(target: Path, value: Any, drop_cached: bool = False) -> None:
    import torch

    with os_compat.open_to_write(target, drop_cached) as handle:  # a Python file: a full disk is an OSError(ENOSPC)
        try:
            torch.save(value, handle)
        except RuntimeError as error:
            # torch's zip writer checks the file's position on its way out of a failed write ("unexpected pos 6656 vs
            # 6548"), and that error replaces the file's own: a disk filled part-way through the file, seen only as
            # a RuntimeError, would reach the user without "disk full". The file's error is the one raised.
            if isinstance(error.__context__, OSError):
                raise error.__context__ from None
            raise


def save_safetensors(path: str | os.PathLike, tensors: dict, what: str, metadata: dict[str, str] | None = None,
                     make_parents: bool = True) -> None:
    at_least = tensor_bytes(tensors)
    write_atomic(path, lambda target: write_safetensors(target, tensors, metadata), what, at_least + 4096,
                 make_parents, at_least)


def make_temp_dir(folder: Path, name: str) -> Path:
    """A fresh temp folder beside `folder / name`, with the mode the umask asks for."""
    path = folder / temp_name(name)
    os.mkdir(path, 0o700)
    os.chmod(path, dir_mode())
    return path


def write_new(path: Path, write: Callable[[Path], None]) -> None:
    """Write a new file inside a temp folder (the folder is renamed into place as a whole)."""
    _new_file(path)
    write(path)
    os_compat.fsync_file(path)
    os.chmod(path, file_mode())
