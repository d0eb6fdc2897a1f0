"""Where caches and datasets live in ComfyUI's folders: the `headroom_cache` model folder (extra_model_paths.yaml may
move it; ours is appended after the yaml's path, so the first path is the one used), the dataset roots the server
reads from, and ComfyUI's folders as user-facing messages name paths in them."""
from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

import folder_paths

from ...training.data.cache_store import CacheStoreError, ShardStore
from ...training.data.dataset import DatasetError
from ...training.data.files import WriteError, display_path, register_display_roots

log = logging.getLogger(__name__)

CACHE_FOLDER_NAME = "headroom_cache"
DATASET_ROOTS_ENV = "HEADROOM_DATASET_ROOTS"
FOLDERS_LISTED = 2000  # the dataset nodes' folder dropdown lists at most this many subfolders of input/
FOLDER_DEPTH = 3  # ... this deep (input/a/b/c)


def register_cache_folder() -> None:
    """Add the default cache folder after any path extra_model_paths.yaml gave (idempotent)."""
    folder_paths.add_model_folder_path(CACHE_FOLDER_NAME, os.path.join(folder_paths.models_dir, CACHE_FOLDER_NAME))


register_cache_folder()


def comfy_folders():
    """(label, folder) of ComfyUI's folders, as user-facing messages name paths in them (training/data/files.py):
    output/, input/, temp/, models/, model folders elsewhere (extra_model_paths.yaml) by their kind, and the
    dataset roots the server owner allows."""
    models = folder_paths.models_dir
    yield "models", models
    for name, (paths, _) in list(folder_paths.folder_names_and_paths.items()):
        for path in paths:
            if not folder_paths.is_within_directory(models, path):
                yield name, path
    yield "output", folder_paths.get_output_directory()
    yield "input", folder_paths.get_input_directory()
    yield "temp", folder_paths.get_temp_directory()
    for index, root in enumerate(dataset_roots(warn=False)[1:]):
        yield f"{DATASET_ROOTS_ENV}[{index}]", root


register_display_roots(comfy_folders)


def cache_root() -> Path:
    return Path(folder_paths.get_folder_paths(CACHE_FOLDER_NAME)[0])


_RELOCATE_HINT = (
    "To keep the cache on another disk, add `headroom_cache: /path/with/space` to ComfyUI's "
    "extra_model_paths.yaml and restart ComfyUI."
)


def with_relocate_hint(error: Exception) -> Exception:
    """The same error, saying how to move the cache to another disk."""
    text = str(error)
    return type(error)(f"{text}{'' if text.endswith('.') else '.'} {_RELOCATE_HINT}")


def open_store(kind: str) -> ShardStore:
    try:
        return ShardStore(cache_root() / kind)
    except (CacheStoreError, WriteError) as error:
        raise with_relocate_hint(error) from error


def dataset_roots(warn: bool = True) -> list[str]:
    """ComfyUI's input directory plus the roots the server owner allows in $HEADROOM_DATASET_ROOTS."""
    roots = [folder_paths.get_input_directory()]
    for root in os.environ.get(DATASET_ROOTS_ENV, "").split(os.pathsep):
        if root.strip():
            if os.path.isabs(root.strip()):
                roots.append(root.strip())
            elif warn:
                log.warning("Headroom: ignoring relative path %r in %s (give absolute paths)", root, DATASET_ROOTS_ENV)
    return roots


def resolve_dataset_folder(folder: str, relative_to: str | None = None) -> Path:
    """The real path of `folder` (relative paths are taken from `relative_to`, default ComfyUI's input
    directory) if it lies inside an allowed root; otherwise a clear error. API clients of a shared
    server can send any string, so `..`, absolute paths and symlinks are all resolved before checking."""
    if not folder.strip():
        raise ValueError("dataset folder is empty: give a folder inside ComfyUI's input directory, e.g. 'my_dataset'")
    if any(ord(c) < 32 for c in folder):
        raise ValueError(f"dataset folder {folder[:120]!r} contains control characters (a newline?): give a plain "
                         "folder name inside ComfyUI's input directory")
    candidate = os.path.join(relative_to or folder_paths.get_input_directory(), folder.strip())
    roots = dataset_roots()
    if any(folder_paths.is_within_directory(root, candidate) for root in roots):
        return Path(os.path.realpath(candidate))
    listed = ", ".join(display_path(root) for root in roots)
    raise ValueError(
        f"dataset folder {folder[:120]!r} is outside the folders this server reads datasets from ({listed}). "
        f"Put the dataset inside ComfyUI's input directory, or have the server's owner add its parent folder to "
        f"the {DATASET_ROOTS_ENV} environment variable ({os.pathsep!r}-separated absolute paths)."
    )


def resolve_folders(folder: str, control_folder: str, mask_folder: str = "") -> tuple[Path, Path | None, Path | None]:
    images = resolve_dataset_folder(folder)
    control = resolve_dataset_folder(control_folder, relative_to=str(images.parent)) if control_folder.strip() else None
    masks = resolve_dataset_folder(mask_folder, relative_to=str(images.parent)) if mask_folder.strip() else None
    return images, control, masks


def dataset_folders() -> list[str]:
    """Subfolders of ComfyUI's input directory ('/'-separated, relative to it, hidden ones left out): the dataset
    nodes' folder choices, listed whenever the editor fetches the node definitions (its refresh lists them again)."""
    root = folder_paths.get_input_directory()
    found: list[str] = []
    for parent, subfolders, _ in os.walk(root):  # symlinked folders are listed, not entered
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        relative = os.path.relpath(parent, root)
        prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"
        found += [prefix + name for name in subfolders]
        if prefix.count("/") + 1 >= FOLDER_DEPTH:
            subfolders[:] = []
        if len(found) >= FOLDERS_LISTED:
            break
    return sorted(found[:FOLDERS_LISTED])


def check_dataset_folder(node: str, folder: str, what: str = "folder") -> Path:
    """The dataset folder `folder` names (resolve_dataset_folder), which must exist; else a ValueError (DatasetError:
    missing) naming the node, and the existing folders closest to what was typed."""
    try:
        path = resolve_dataset_folder(folder)
    except ValueError as error:
        raise ValueError(f"{node}: {error}") from None
    if path.is_dir():
        return path
    choices = dataset_folders()
    close = difflib.get_close_matches(folder.strip(), choices, n=5, cutoff=0.5)
    hint = (f"closest existing: {', '.join(map(repr, close))}" if close else
            f"existing: {', '.join(map(repr, choices[:10]))}{', ...' if len(choices) > 10 else ''}" if choices else
            "it has no subfolders yet")
    raise DatasetError(f"{node}: {what} {folder[:120]!r} is not a folder in ComfyUI's input directory "
                     f"({display_path(folder_paths.get_input_directory())}; {hint}). Put the images there, or pick "
                     "a folder from the list (press R in the editor to list new folders).")
