"""Everything Headroom does differently on Windows than on Linux / macOS, in one module.

Most ComfyUI users run the Windows portable build or ComfyUI Desktop. Code elsewhere in the pack calls these
functions instead of POSIX-only modules and calls (tests/unit/test_import_graph.py rejects `resource`, `fcntl`,
`os.kill`, `os.open`, `os.fsync`, AF_UNIX, /proc and text-mode opens without an encoding anywhere else):

- process memory: psutil (Windows: the peak working set), /proc/self/status on Linux, `resource` only on macOS;
  freed tensors' memory given back to the OS (glibc's malloc_trim on Linux; Windows and macOS do it themselves);
- files: `os.open` with O_BINARY (without it Windows opens in text mode: CR-LF translation and 0x1A as end of file),
  no O_NOFOLLOW on Windows (a symlink is refused by lstat instead), folders fsynced only where they can be opened,
  a checkpoint's pages dropped from the page cache as they reach the disk (posix_fadvise: Linux);
- process liveness: psutil on Windows (there `os.kill(pid, 0)` is CTRL_C_EVENT to the console ComfyUI runs in);
- names and paths Windows cannot create (CON, NUL, COM1, trailing dots / spaces, `<>:"|?*`) and its 260-character
  path limit; names are checked on every OS, since a workflow made on Linux is queued on Windows too;
- replacing a file another program holds open (a LoRA ComfyUI loaded, an antivirus scan): retried, then an error
  naming the file and the likely holder;
- several GPUs: Linux only (NCCL and the AF_UNIX sockets of the rank workers).

`WINDOWS` picks the branch. It is read at call time, so tests/windows/ sets it to take the Windows branch on Linux
while imitating what Windows does where it differs.
"""
from __future__ import annotations

import errno
import io
import os
import re
import stat
import sys
import threading
import time

WINDOWS = sys.platform == "win32"

# --- process memory --------------------------------------------------------------------------------------------


def _proc_status(field: str) -> str | None:
    """The first word of a field of /proc/self/status (Linux), or None where there is no such file or field."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return line.split()[1]
    except (OSError, IndexError):
        return None
    return None


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes, or None."""
    value = _proc_status(field)
    return int(value) * 1024 if value is not None and value.isdigit() else None


def process_rss_bytes() -> int | None:
    """This process's resident set (Windows: working set) in bytes, or None where nothing reports it."""
    try:
        import psutil  # ComfyUI requires it
    except ImportError:
        return None if WINDOWS else _proc_status_bytes("VmRSS")
    return int(psutil.Process().memory_info().rss)


def process_peak_rss_bytes() -> int | None:
    """Peak resident set: since the last `reset_peak_rss` on Linux, since the process started elsewhere."""
    if WINDOWS:
        try:
            import psutil
        except ImportError:
            return None
        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))  # peak_wset: Windows' peak working set
    peak = _proc_status_bytes("VmHWM")  # Linux; the value /proc/self/clear_refs resets
    if peak is not None:
        return peak
    try:
        import resource  # macOS and other POSIX systems: no /proc
    except ImportError:
        return process_rss_bytes()
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB elsewhere


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); False where the OS cannot (peaks count from start)."""
    if WINDOWS:
        return False
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")  # "5" resets only the peak RSS, nothing else
        return True
    except OSError:
        return False


_malloc_trim = None  # glibc's malloc_trim, looked up once (False: this libc has none)


def release_freed_host_memory() -> bool:
    """Give the OS back the host memory that freed tensors left in the C heap; True where something was given back.

    glibc keeps a freed block below its mmap threshold in its heap, and the first large free raises that threshold to
    32 MiB: the host tensors a load moves to the card and back, and the per-tensor copies the weight streamer packs
    into one buffer per block, then stay in the process's resident set although nothing uses them (the GPU kit on an
    H200: Flux.1-dev's RSS over training grew with the budget, 30.7 / 34.8 / 38.7 GiB at 8 / 12 / 16 GiB, for 20.6
    GiB of weights). glibc's malloc_trim(0) returns their whole pages. Windows' heap gives large freed blocks back
    by itself, and macOS's allocator too: nothing to do there; other libcs (musl) have no malloc_trim."""
    global _malloc_trim
    if WINDOWS or not sys.platform.startswith("linux"):
        return False
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    return bool(_malloc_trim and _malloc_trim(0))


_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask (Windows keeps one too, for os.chmod's read-only bit); read without changing it on Linux."""
    value = None if WINDOWS else _proc_status("Umask")
    if value is not None:
        try:
            return int(value, 8)
        except ValueError:
            pass
    with _umask_lock:  # elsewhere it can only be read by setting it (and setting it back)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


# --- files -----------------------------------------------------------------------------------------------------


def _binary() -> int:
    return getattr(os, "O_BINARY", 0)  # read at call time: the Windows test tier sets it


def create_new_file(path: str | os.PathLike) -> None:
    """Create `path` empty, exclusively (an existing file or symlink of that name is an error), mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _binary() | getattr(os, "O_NOFOLLOW", 0)
    os.close(os.open(path, flags, 0o600))


FILE_ATTRIBUTE_REPARSE_POINT = 0x400
IO_REPARSE_TAG_NAME_SURROGATE = 0x20000000  # the tag's bit for "names another file": symlinks, junctions


def _names_another_file(status: os.stat_result) -> bool:
    """Whether an lstat result is a symlink or a Windows reparse point that names another file (a junction). Other
    reparse points are the file itself: compressed by Windows (compact.exe, CompactGUI: WOF), deduplicated, a
    cloud placeholder; refusing them refused a user's compressed dataset or models folder."""
    if stat.S_ISLNK(status.st_mode):
        return True
    if not getattr(status, "st_file_attributes", 0) & FILE_ATTRIBUTE_REPARSE_POINT:
        return False
    tag = getattr(status, "st_reparse_tag", None)
    return tag is None or bool(tag & IO_REPARSE_TAG_NAME_SURROGATE)


def open_no_follow(path: str | os.PathLike) -> int:
    """A binary read-only descriptor of `path`; OSError(ELOOP) when `path` is a symlink. FIFOs do not block."""
    if WINDOWS:  # no O_NOFOLLOW: refuse a symlink (or junction) by lstat, then check the opened file is that one
        before = os.lstat(path)
        if _names_another_file(before):
            raise OSError(errno.ELOOP, "is a symlink", str(path))
        fd = os.open(path, os.O_RDONLY | _binary())
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise OSError(errno.ELOOP, "was replaced while opened", str(path))
        return fd
    return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))


def _fsync_descriptor(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF):  # file systems and devices that cannot fsync are let be
            raise


def _fsync(path: str | os.PathLike, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        _fsync_descriptor(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file to disk."""
    # Windows flushes only through a handle with write access (FlushFileBuffers): O_RDWR there.
    _fsync(path, (os.O_RDWR if WINDOWS else os.O_RDONLY) | _binary())


def fsync_folder(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable. Windows cannot open a folder (and NTFS journals renames): nothing there."""
    if not WINDOWS:
        _fsync(path, os.O_RDONLY)


def _can_drop_cached() -> bool:
    """Windows and macOS have no posix_fadvise: files written there stay as they were."""
    return not WINDOWS and hasattr(os, "posix_fadvise")


# While a file that leaves the page cache is written, its written part is flushed and dropped every this many
# bytes: what it holds in the cache at once, whatever its size (a full fine-tune's optimizer state: tens of GB).
DROP_BEHIND_BYTES = 256 << 20


class _DropBehindFile(io.FileIO):
    """A file written front to back whose pages leave the page cache as they reach the disk: every DROP_BEHIND_BYTES
    written, and the rest when it is closed. By hand: Python has no sync_file_range, and the libraries write through
    a file object. The fsync of each part takes the disk time the file's final fsync would have taken. After a
    failed write (a full disk) nothing more is flushed: the write's own error is the one raised."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, "wb")
        self._dropped, self._failed = 0, False

    def write(self, data) -> int:
        try:
            written = super().write(data)
            end = self.tell()
            if end - self._dropped >= DROP_BEHIND_BYTES:
                self._drop_to(end)
        except BaseException:
            self._failed = True
            raise
        return written

    def _drop_to(self, end: int) -> None:
        _fsync_descriptor(self.fileno())  # a dirty page is not dropped
        try:
            os.posix_fadvise(self.fileno(), self._dropped, end - self._dropped, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only: a file system that ignores it keeps the pages, as without it
            pass
        self._dropped = end

    def close(self) -> None:
        try:
            if not self.closed and not self._failed:
                self._drop_to(self.tell())
        finally:
            super().close()


def open_to_write(path: str | os.PathLike, drop_cached: bool = False) -> io.BufferedIOBase:
    """`path` opened to write, binary. `drop_cached`: for a large file read back rarely, such as a run's checkpoint,
    its pages leave the page cache as they reach the disk (Linux). Linux keeps written pages cached and, short of
    memory, reclaims the oldest first: a model file read when ComfyUI loaded it goes before the checkpoints written
    since, and its next use reads it from disk again (bench/bench_checkpoint_cache.py: a 6 GiB model 0 % cached
    after three 4 GiB checkpoints, 99 % when they are dropped; docs/BENCHMARKS.md)."""
    if drop_cached and _can_drop_cached():
        return io.BufferedWriter(_DropBehindFile(path), buffer_size=1 << 20)
    return open(path, "wb")


class FileInUseError(PermissionError):
    """Windows refused to replace or remove a file another program holds open; the message names the file."""


class ReadOnlyFileError(PermissionError):
    """Windows refused to replace a file whose Read-only attribute is set; the message names the file."""


def _read_only(path: str | os.PathLike) -> bool:
    """Whether `path` is a file with Windows' Read-only attribute (st_mode without S_IWRITE there)."""
    try:
        status = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(status.st_mode) and not status.st_mode & stat.S_IWRITE


REPLACE_WAIT_S = 5.0  # how long a replace blocked by another program is retried (an antivirus scan takes ~1 s)
LIKELY_HOLDERS = ("ComfyUI itself (a Load LoRA / Load Checkpoint node has the file loaded: remove that node or load "
                  "another file first), an antivirus scan, Explorer's preview pane, or a program the file is open in")
# A folder is renamed into place (a checkpoint) only after its files were written: Windows refuses the rename while
# another program has one of them open, which is when antivirus and sync programs read a new file (a multi-GB
# optimizer state takes them longer than a LoRA): retried longer, and named for what holds it.
FOLDER_REPLACE_WAIT_S = 30.0
FOLDER_HOLDERS = ("an antivirus scan or a sync / backup program (OneDrive, Dropbox) reading the files just written in "
                  "it, or Explorer showing that folder")


def replace(source: str | os.PathLike, target: str | os.PathLike, what: str = "file") -> None:
    """os.replace, which on Windows fails (WinError 5 / 32) while another program has `target` open (or, for a
    folder, a file in `source`): retried for REPLACE_WAIT_S (a folder: FOLDER_REPLACE_WAIT_S), then a FileInUseError
    naming `what`, the file and the programs that usually hold one. A target with the Read-only attribute (which
    Windows never replaces; Linux and macOS do, as the folder allows) is a ReadOnlyFileError at once."""
    folder = os.path.isdir(source)
    deadline = time.monotonic() + (FOLDER_REPLACE_WAIT_S if folder else REPLACE_WAIT_S)
    delay = 0.05
    while True:
        try:
            os.replace(source, target)
            return
        except PermissionError as error:
            if not WINDOWS:
                raise
            if not folder and _read_only(target):
                raise ReadOnlyFileError(
                    error.errno, f"{what} is read-only (its Read-only attribute is set) and could not be replaced. "
                    "Clear Read-only in the file's Properties, or save under another name, then queue again",
                    str(target)) from error
            if time.monotonic() >= deadline:
                done, holders = ("moved into place", FOLDER_HOLDERS) if folder else ("replaced", LIKELY_HOLDERS)
                raise FileInUseError(
                    error.errno, f"{what} is in use by another program and could not be {done}. Likely holders: "
                    f"{holders}. Close it, then queue again", str(target)) from error
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (a temp file's writer, say)."""
    if WINDOWS:  # never os.kill(pid, 0): on Windows signal 0 is CTRL_C_EVENT, sent to the whole console
        try:
            import psutil
        except ImportError:
            return True  # unknown: the caller keeps the file, which is the safe side
        return psutil.pid_exists(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# --- names and paths -------------------------------------------------------------------------------------------

_RESERVED = {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$", *(f"{kind}{digit}" for kind in ("COM", "LPT")
                                                               for digit in "123456789\u00b9\u00b2\u00b3")}
_FORBIDDEN = re.compile(r'[<>:"/\\|?*\x00-\x1f]')


def windows_name_problem(name: str) -> str | None:
    """Why Windows cannot create a file or folder named `name`, or None. Checked on every OS: a run name in a
    workflow made on Linux is queued on Windows too."""
    if _FORBIDDEN.search(name):
        return "Windows does not allow the characters < > : \" / \\ | ? * in names"
    if name.endswith((".", " ")):
        return "Windows drops a trailing dot or space from names, so the folder would not be the one named"
    if name.split(".")[0].rstrip(" ").upper() in _RESERVED:
        return f"{name.split('.')[0]!r} is a device name on Windows (CON, PRN, AUX, NUL, COM1-9, LPT1-9)"
    return None


MAX_PATH = 260  # Windows' classic path limit, characters including the drive and the final NUL


def long_paths_enabled() -> bool:
    """Whether Windows lets this Python use paths past MAX_PATH (the LongPathsEnabled policy; python.exe is
    long-path aware, so the policy decides). Always True elsewhere."""
    if not WINDOWS:
        return True
    try:
        import winreg
    except ImportError:
        return False
    try:
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SYSTEM\CurrentControlSet\Control\FileSystem") as key:
            return bool(winreg.QueryValueEx(key, "LongPathsEnabled")[0])
    except OSError:
        return False


def path_length_problem(folder: str | os.PathLike, longest_inside: int) -> str | None:
    """Why files up to `longest_inside` characters deep in `folder` cannot be written on this machine, or None:
    on Windows without long paths, a full path must stay under MAX_PATH characters."""
    if long_paths_enabled():
        return None
    length = len(os.path.abspath(folder)) + 1 + longest_inside
    if length < MAX_PATH:
        return None
    return (f"its files would have paths of {length} characters, and Windows allows {MAX_PATH - 1} here: use a shorter "
            f"name (at least {length - MAX_PATH + 1} characters shorter), move ComfyUI to a shorter folder (e.g. "
            "C:\\ComfyUI), or enable Windows long paths (the LongPathsEnabled setting)")


# --- several GPUs ----------------------------------------------------------------------------------------------


def several_devices_problem(fix: str = "Set devices to 1 (one GPU trains as always)") -> str | None:
    """Why training on several devices cannot run here, or None; `fix`: what the user does instead."""
    if WINDOWS:
        return ("training on several devices runs on Linux only: Windows has neither NCCL nor the AF_UNIX sockets "
                f"Headroom's rank processes talk through. {fix}")
    return None


# --- folders users fill in Explorer / Finder -----------------------------------------------------------------------

# Files the OS's file managers write into any folder of pictures: never part of a data set, on any OS (a folder
# copied from Windows to a Linux server keeps its Thumbs.db).
OS_MADE_FILES = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini", "icon\r", ".ds_store"})
_HIDDEN_OR_SYSTEM = 0x2 | 0x4  # FILE_ATTRIBUTE_HIDDEN | FILE_ATTRIBUTE_SYSTEM


def is_hidden(path: str | os.PathLike) -> bool:
    """Whether a file manager hides `path`: a dot name, a file the OS made (Thumbs.db, desktop.ini, .DS_Store), or
    on Windows the hidden / system attribute."""
    name = os.path.basename(path)
    if name.startswith(".") or name.lower() in OS_MADE_FILES:
        return True
    if WINDOWS:
        try:
            return bool(getattr(os.lstat(path), "st_file_attributes", 0) & _HIDDEN_OR_SYSTEM)
        except OSError:
            return False
    return False
