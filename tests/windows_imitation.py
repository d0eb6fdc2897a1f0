"""Windows, imitated on Linux, for the Windows-semantics test tier (tests/windows/).

No Windows machine runs these tests, so this makes training/os_compat.py take its Windows branch and makes the
process behave as Windows does where the pack once relied on POSIX:
- `resource`, `fcntl`, `termios` do not import from the pack's code (and no `winreg`: long paths are off);
- a folder cannot be opened with `os.open` (PermissionError, as Windows' CreateFile on a directory);
- `os.open` without `O_BINARY` is text mode: a read sees CR-LF as LF and stops at the first 0x1A byte (as the C
  runtime's _read does); a write in text mode would turn every LF byte into CR-LF, which this cannot do to a raw
  descriptor, so it is refused with that reason (code that would corrupt a file on Windows fails here);
- `os.kill(pid, 0)` is CTRL_C_EVENT to the console: raised as ImitatedCtrlC;
- a file another program holds open (`hold_open`) cannot be replaced or removed (PermissionError, WinError 32), nor
  the folder it is in renamed; nor can a file with the Read-only attribute (no write bit in st_mode: WinError 5);
- nor a file this process has memory-mapped (safetensors' `safe_open`, torch's `mmap=True`: WinError 1224, "a file
  with a user-mapped section open") or still open (Python's `open` and `os.open` share no delete access there),
  read from /proc/self/maps and /proc/self/fd at each call, so whatever holds it is caught;
- shutil.rmtree and tempfile take their Windows paths (no descriptor-based walk; O_BINARY in tempfile's flags);
- `os` has none of O_NOFOLLOW, O_NONBLOCK, O_DIRECTORY, posix_fadvise.
The descriptor rules apply to calls made from the pack's own code (nodes/, training/, workflows/): libraries keep
their Linux paths, as on Windows they have their own Windows paths.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import os
import pathlib
import shutil
import stat
import sys
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACK_FOLDERS = tuple(str(REPO / folder) + os.sep for folder in ("nodes", "training", "workflows"))
O_BINARY = 0x8000  # Windows' value
BLOCKED_MODULES = ("resource", "fcntl", "termios", "pty", "tty", "pwd", "grp", "winreg")  # winreg: no long paths


def mapped_files() -> set[str]:
    """The files this process has memory-mapped now (Linux's /proc/self/maps: real paths)."""
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
        return {fields[5] for fields in (line.rstrip("\n").split(maxsplit=5) for line in maps)
                if len(fields) == 6 and fields[5].startswith(os.sep) and not fields[5].endswith(" (deleted)")}


def open_files() -> set[str]:
    """The regular files this process has open now (Linux's /proc/self/fd: real paths)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(os.sep) and not target.endswith(" (deleted)") and os.path.isfile(target):
            found.add(target)
    return found


class ImitatedCtrlC(AssertionError):
    """os.kill(pid, 0) on Windows sends CTRL_C_EVENT to the console: ComfyUI (and every program in it) stops."""


def _from_the_pack() -> bool:
    frame = sys._getframe(2)
    return frame.f_code.co_filename.startswith(PACK_FOLDERS)


class WindowsImitation:
    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self._patch = monkeypatch
        self.held: set[str] = set()

    def install(self) -> "WindowsImitation":
        from headroom.training import os_compat

        patch = self._patch
        patch.setattr(os_compat, "WINDOWS", True)
        real_import = builtins.__import__

        def imitated_import(name, globals=None, locals=None, fromlist=(), level=0):
            # The pack's `import resource` fails as on Windows; libraries keep their own (Linux) imports.
            if level == 0 and name.split(".")[0] in BLOCKED_MODULES and (globals or {}).get("__name__", "").startswith(
                    "headroom"):
                raise ModuleNotFoundError(f"No module named {name!r} (imitated Windows)", name=name)
            return real_import(name, globals, locals, fromlist, level)

        patch.setattr(builtins, "__import__", imitated_import)
        patch.setattr(os, "O_BINARY", O_BINARY, raising=False)
        for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_DIRECTORY", "posix_fadvise", "POSIX_FADV_DONTNEED"):
            patch.delattr(os, name, raising=False)
        patch.setattr(shutil, "_use_fd_functions", False)  # rmtree's Windows walk
        patch.setattr(shutil.rmtree, "avoids_symlink_attacks", False)
        patch.setattr(tempfile, "_bin_openflags", tempfile._bin_openflags | O_BINARY)
        real_open, real_kill = os.open, os.kill
        real_replace, real_rename, real_unlink, real_remove = os.replace, os.rename, os.unlink, os.remove

        def imitated_open(path, flags, mode=0o777, *, dir_fd=None):
            if not _from_the_pack():
                return real_open(path, flags, mode, dir_fd=dir_fd)
            if os.path.isdir(path):
                raise PermissionError(errno.EACCES, "Access is denied (Windows cannot open a folder)", str(path))
            if flags & O_BINARY:
                return real_open(path, flags & ~O_BINARY, mode, dir_fd=dir_fd)
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EINVAL, "imitated Windows: os.open without O_BINARY writes in text mode "
                              "(every LF byte becomes CR-LF)", str(path))
            with open(path, "rb") as handle:  # what the C runtime's text-mode _read returns
                seen = handle.read().replace(b"\r\n", b"\n").split(b"\x1a")[0]
            copy = tempfile.TemporaryFile()
            copy.write(seen)
            copy.seek(0)
            fd = os.dup(copy.fileno())
            copy.close()
            return fd

        def imitated_kill(pid, signal_number):
            if signal_number == 0 and _from_the_pack():  # (psutil's Linux backend probes this way itself)
                raise ImitatedCtrlC(f"os.kill({pid}, 0) on Windows is CTRL_C_EVENT: it would stop ComfyUI's console")
            return real_kill(pid, signal_number)

        def held_check(*paths):
            for path in paths:
                key = os.path.abspath(path)
                # a held file, or a folder with one inside (Windows renames no folder while a file in it is open)
                if any(held == key or held.startswith(key + os.sep) for held in self.held):
                    raise PermissionError(errno.EACCES, "The process cannot access the file because it is being "
                                          "used by another process", str(path))
                real = os.path.realpath(path)
                if any(mapped == real or mapped.startswith(real + os.sep) for mapped in mapped_files()):
                    raise PermissionError(errno.EACCES, "The requested operation cannot be performed on a file with "
                                          "a user-mapped section open", str(path))
                if any(held == real or held.startswith(real + os.sep) for held in open_files()):
                    raise PermissionError(errno.EACCES, "The process cannot access the file because it is being "
                                          "used by another process (this one holds it open)", str(path))

        def read_only_check(path):
            # Windows neither replaces nor removes a file whose Read-only attribute is set (st_mode without S_IWRITE)
            if os.path.isfile(path) and not os.stat(path).st_mode & stat.S_IWRITE:
                raise PermissionError(errno.EACCES, "Access is denied", str(path))

        patch.setattr(os, "open", imitated_open)
        patch.setattr(os, "kill", imitated_kill)
        imitated = {
            "replace": lambda src, dst, **kw: (held_check(src, dst), read_only_check(dst),
                                               real_replace(src, dst, **kw))[-1],
            "rename": lambda src, dst, **kw: (held_check(src, dst), real_rename(src, dst, **kw))[1],
            "unlink": lambda path, **kw: (held_check(path), read_only_check(path), real_unlink(path, **kw))[-1],
            "remove": lambda path, **kw: (held_check(path), read_only_check(path), real_remove(path, **kw))[-1],
        }
        for name, function in imitated.items():
            patch.setattr(os, name, function)
        # Python 3.10's pathlib took os.unlink / rename / replace when it was imported (its _NormalAccessor; 3.11
        # calls os.* each time): without this, Path.unlink of a mapped file succeeded in the imitation on 3.10.
        accessor = getattr(pathlib, "_normal_accessor", None)
        if accessor is not None:
            for name in ("unlink", "rename", "replace"):
                patch.setattr(accessor, name, imitated[name])
        return self

    @contextlib.contextmanager
    def hold_open(self, path):
        """Another program has `path` open without FILE_SHARE_DELETE (ComfyUI's loaded LoRA, an antivirus scan)."""
        key = os.path.abspath(path)
        self.held.add(key)
        try:
            yield
        finally:
            self.held.discard(key)
