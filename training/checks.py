"""Checks every node's inputs share.

Float inputs: ComfyUI checks a FLOAT input against its min / max, but NaN compares false both ways (and an API
prompt's JSON may carry NaN or Infinity, which Python's json reads), so a NaN passed every range check, switched
features off silently and was stored in config.json, making the run unresumable. Every float a node takes goes
through `check_finite`.

Optional packages (bitsandbytes, prodigyopt, came-pytorch) are not installed with Headroom (their installs may change
the packages ComfyUI runs on): a choice that needs one goes through `require_package`, which names the pip line.
"""
from __future__ import annotations

import importlib
import math

from . import public_module


def named(owner: str, message: str) -> str:
    """`message` as `owner` (a node's display name) says it: starting with "<owner>: " once (a deeper check that was
    given the name may have put it there already)."""
    return message if message.startswith(f"{owner}: ") else f"{owner}: {message}"


def check_finite(owner: str, **values) -> None:
    """Raise ValueError naming `owner` and the input when any of `values` is a NaN or infinite float."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{owner}: {name}={value} is not a finite number; give a number (e.g. its default)")


class MissingPackageError(ImportError):
    """An optional package a chosen setting needs does not import; the message names the pip line that installs it."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


def require_package(module: str, package: str, needed_by: str, instead: str) -> None:
    """Raise MissingPackageError when `module` does not import: `needed_by` (the setting, e.g. "optimizer Prodigy")
    needs pip package `package`; `instead` says what to choose without it."""
    top = module.split(".")[0]
    try:
        importlib.import_module(top)  # first: a submodule already imported is found without its package
        importlib.import_module(module)
    except Exception as error:  # a broken install (a missing CUDA library...) raises more than ImportError
        missing = isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == top
        state = "which is not installed" if missing else f"which is installed but does not import ({error})"
        # --no-deps: a forced reinstall also reinstalls every dependency at its newest, torch among them (bitsandbytes
        # and peft depend on it): a user's CUDA torch replaced by PyPI's, which on Windows is the CPU build.
        pip = f"-m pip install {'' if missing else '--force-reinstall --no-deps '}{package}"
        # A package that failed part-way may have loaded its library: Windows keeps a loaded DLL locked, and pip's
        # reinstall then fails with "Access is denied" while ComfyUI runs.
        how = ("Install it into ComfyUI's Python" if missing else
               "Close ComfyUI (Windows keeps a loaded package's files locked), then reinstall it with ComfyUI's Python")
        again = "then restart ComfyUI" if missing else "then start ComfyUI again"
        raise MissingPackageError(
            f"{needed_by} needs the pip package '{package}', {state}. {how}: python {pip} (Windows portable build, in "
            f"its folder: python_embeded\\python.exe {pip}), {again}; or {instead}.") from None


# peft 0.15 and later import accelerate's `clear_device_cache` (new in accelerate 0.32) but declare accelerate 0.21 or
# later, so pip keeps an older accelerate a ComfyUI holds (another node's) and installs a peft that does not import.
PEFT_NEEDS_ACCELERATE = ("0.15", "0.32")


def require_peft(needed_by: str, instead: str) -> None:
    """Raise MissingPackageError when peft does not import, before a run: as require_package, except where the
    installed packages' metadata shows the cause, peft 0.15+ beside accelerate < 0.32: then naming both ways out."""
    try:
        require_package("peft", "peft", needed_by, instead)
    except MissingPackageError as error:
        from importlib import metadata

        from packaging.version import Version

        try:
            peft, accelerate = metadata.version("peft"), metadata.version("accelerate")
        except metadata.PackageNotFoundError:
            raise error from None
        new_peft, old_accelerate = PEFT_NEEDS_ACCELERATE
        if Version(peft) < Version(new_peft) or Version(accelerate) >= Version(old_accelerate):
            raise
        upgrade, older_peft = f'-m pip install "accelerate>={old_accelerate},<1.16"', '-m pip install "peft==0.14.0"'
        raise MissingPackageError(
            f"{needed_by} needs peft, which does not import here: this ComfyUI's Python has peft {peft} and accelerate "
            f"{accelerate}, and peft {new_peft} and later use a function accelerate added in {old_accelerate} (they "
            f"declare accelerate 0.21 or later, so pip kept the older one). Upgrade accelerate: python {upgrade}, or "
            f"keep it and install the last peft that imports with it: python {older_peft} (Windows portable build, in "
            f"its folder: python_embeded\\python.exe in place of python); then restart ComfyUI; or {instead}.") from None


def require_version(module: str, minimum: str, needed_by: str, why: str, instead: str) -> None:
    """Raise MissingPackageError when the installed `module` (its pip package of that name) is older than `minimum`:
    `needed_by` needs that release; `why` says what the older one does; `instead` what to choose without it.
    Headroom never upgrades a package a user's ComfyUI holds (requirements.txt): an older one is named here, at the
    setting."""
    from packaging.version import Version

    installed = str(getattr(importlib.import_module(module), "__version__", "0"))
    if Version(installed) < Version(minimum):
        pip = f'-m pip install --upgrade "{module}>={minimum}"'
        raise MissingPackageError(
            f"{needed_by} needs the pip package '{module}' {minimum} or later; this ComfyUI's Python has {installed}, "
            f"{why}. Upgrade it: python {pip} (Windows portable build, in its folder: python_embeded\\python.exe "
            f"{pip}), then restart ComfyUI; or {instead}.")
