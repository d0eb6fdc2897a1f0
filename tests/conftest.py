"""Shared test set-up.

The repository root is registered as the package `headroom` (tests import `headroom.training...`).
No test puts the repo root on sys.path, where our `nodes/` package would shadow ComfyUI's `nodes.py`
(pytest runs in importlib mode, see pyproject.toml). Fixtures for a real ComfyUI come from the
harness modules in this folder. Tests live in one folder per kind: unit/ (no ComfyUI), comfy/ (in-process ComfyUI),
server/ (a ComfyUI server subprocess), browser/, realsize/; the shared harness and helpers stay here.
"""
import importlib.util
import os
import pathlib
import sys

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def _register_package_alias(name: str = "headroom") -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_register_package_alias()
# harness helper modules, and the kind folders whose test modules other tests import helpers from; appended so
# they never shadow ComfyUI
for folder in (TESTS_DIR, TESTS_DIR / "unit", TESTS_DIR / "comfy", TESTS_DIR / "browser"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

import pytest  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test (modules of tiny-model tests use it for every test:
    `pytest.mark.usefixtures("one_torch_thread")`): one thread is fastest for tiny models, and far faster than two
    on a busy 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def torch_threads_per_worker() -> int | None:
    """Torch threads for each pytest-xdist worker: the machine's cores shared out (1 each on the 2-core CI box).
    None outside xdist (the process keeps OMP_NUM_THREADS / torch's default)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return max(1, (os.cpu_count() or 1) // int(workers)) if workers else None


# Subprocesses started by tests (the real-size workers, tests/realsize_worker.py and realsize_full.py) take their
# torch threads from here: the worker's share, as the tests in process do.
if torch_threads_per_worker() is not None:
    os.environ.setdefault("HEADROOM_TORCH_THREADS", str(torch_threads_per_worker()))


@pytest.fixture(autouse=True)
def worker_torch_threads(request):
    """Each test starts on its worker's share of the cores, real-size tests too. Two workers of two threads each on
    two cores run tiny models 2.6x slower than one thread each (the threads wait on each other's time slices); a
    module that sets torch's threads at import (collection imports every module in every worker) would otherwise set
    them for all tests. Real-size tests took every core until measured beside a one-thread worker: SD3.5's lean full
    fine-tune (realsize_full.py --lean sd35_large --depth 1) ran 56 s on one thread against 73 s on two, and the
    other worker did 20 % more work meanwhile (a large product alone still gains from a second thread)."""
    share = torch_threads_per_worker()
    if share is not None:
        import torch

        torch.set_num_threads(share)
    yield


@pytest.fixture(autouse=True)
def headroom_environment_kept(request):
    """A test leaves the HEADROOM_* variables as it found them (monkeypatch's setenv undoes itself). One that ran the
    distributed script's main() in-process left HEADROOM_DATASET_ROOTS set to its temp folder's parent, and every
    hostile-input test after it in the same worker found datasets outside ComfyUI's input folder readable."""
    def headroom_variables() -> dict[str, str]:
        return {name: value for name, value in os.environ.items() if name.startswith("HEADROOM_")}

    before = headroom_variables()
    yield
    after = headroom_variables()
    if after != before:
        for name in after.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        pytest.fail(f"{request.node.nodeid} changed {changed} in os.environ and left them: use monkeypatch.setenv")


from comfy_harness import cache_dir, comfyui, headroom_nodes  # noqa: E402,F401  (fixtures)
from server_harness import comfy_server  # noqa: E402,F401  (fixture: a real ComfyUI server subprocess)


# Tests that share a worker process under pytest-xdist's `--dist loadfile` (.ci/test runs `-n 2 --dist loadfile`):
# each file's tests (its module-scoped fixtures build once), as loadfile does, and besides all of the realsize tier
# (each test peaks near 14 GiB RAM: never two at once; their model files are built once) and all server and browser
# tests (one ComfyUI server subprocess for them). By node id, as the scheduler sees only those: pytest 9 derives node
# ids from the collection tree, so xdist's own `xdist_group` marks (loadgroup) no longer reach it.
SHARED_WORKER_FOLDERS = {"realsize": "realsize", "server": "server", "browser": "server"}


def worker_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return SHARED_WORKER_FOLDERS.get(folder, path)


# The two long shared scopes go out first, one to each worker (longest first): the realsize tier (~25 min on the quiet
# 2-core box) and the server + browser tests (~12 min); every other file then goes to whichever worker is free. xdist's
# own order (most tests first) dealt both to one worker, which ran ~20 min after the other had finished.
LONG_SCOPES_FIRST = ("realsize", "server")


def _scope_rank(nodeid: str) -> int:
    scope = worker_scope(nodeid)
    return LONG_SCOPES_FIRST.index(scope) if scope in LONG_SCOPES_FIRST else len(LONG_SCOPES_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _scope_rank(item.nodeid))  # stable: each file keeps its order


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice; only exists with xdist installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndTier(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection order above (long scopes first) is the order

        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ByFileAndTier(config, log)
