"""A real ComfyUI server as a subprocess, for integration tests.

`start_comfy_server(base_dir, with_headroom)` runs
    python <ComfyUI>/main.py --cpu --listen 127.0.0.1 --port <free> --base-directory <base_dir>
with this repository linked as <base_dir>/custom_nodes/comfyui-headroom (or without it, to compare
against a stock ComfyUI), waits until it answers, and returns a `ComfyServer`: the HTTP/websocket
client of workflows/headroom_run.py (queue, wait, run_workflow, history, object_info, interrupt,
free, view) plus the process, its log and its base directory. The server is always shut down:
`stop()` / the context manager, and the kernel ends it if the test process itself dies.
The `comfy_server` fixture is one such server with Headroom, shared by the whole test session.
ComfyUI is found by comfy_harness.find_comfyui(); none found: the tests skip with one line.
"""
from __future__ import annotations

import ctypes
import io
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error

import numpy as np
import pytest
from PIL import Image
from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH, REPO_ROOT
from headroom.workflows.headroom_run import ComfyClient, WorkflowError  # noqa: F401  (WorkflowError: for tests)

PACKAGE_DIR_NAME = "comfyui-headroom"
# How long a test waits for something that normally takes seconds (a cancel to land, a short workflow to finish)
# before calling it a hang: generous, since a loaded 2-core machine runs everything several times slower (a 120 s
# limit failed there while nothing hung). HEADROOM_TEST_WAIT_S overrides it.
HANG_LIMIT_S = float(os.environ.get("HEADROOM_TEST_WAIT_S", "900"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end_with_parent() -> None:
    # Linux: the server gets SIGTERM if the test process dies without cleaning up (e.g. SIGKILL),
    # so no stray ComfyUI is left running on a shared machine.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class ComfyServer(ComfyClient):
    """A ComfyUI server process this test session started, and the client to talk to it."""

    def __init__(self, process: subprocess.Popen, port: int, base_dir: pathlib.Path, log_path: pathlib.Path):
        super().__init__("127.0.0.1", port)
        self.process = process
        self.base_dir = base_dir
        self.log_path = log_path
        self.startup_log = ""  # the log up to readiness: where import errors of custom nodes show up

    def log_text(self) -> str:
        """Everything the server printed so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def check_server(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with code {self.process.returncode}; log tail:\n{self.log_tail()}")

    def output_path(self, file: dict) -> pathlib.Path:
        """Where an output file reference from /history lies on disk."""
        return self.base_dir / file.get("type", "output") / file.get("subfolder", "") / file["filename"]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_server()
            try:
                self._request("GET", "/system_stats", timeout=5)
                self.startup_log = self.log_text()
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        self.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ComfyServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def output_pixels(server: ComfyServer, execution) -> np.ndarray:
    """The one PNG an execution saved to the output folder, as int16 pixels (differences do not wrap); a validation's
    before/after grid (shown on the node beside the samples when compare_base is on) is not it."""
    [file] = [f for f in execution.files() if f.get("type") == "output" and f["filename"].endswith(".png")
              and not f["filename"].endswith("_before_after.png")]
    return np.asarray(Image.open(io.BytesIO(server.view(**file))), dtype=np.int16)


def start_comfy_server(base_dir: pathlib.Path, with_headroom: bool = True, extra_args: tuple[str, ...] = (),
                       ready_timeout: float = 180, extra_env: dict[str, str] | None = None) -> ComfyServer:
    """Start ComfyUI on a free port with `base_dir` as its base directory (`extra_env`: added to its environment);
    skip the test if there is no ComfyUI."""
    if COMFYUI_PATH is None:
        pytest.skip(COMFYUI_FOUND_BY)
    base_dir = pathlib.Path(base_dir)
    custom_nodes = base_dir / "custom_nodes"
    custom_nodes.mkdir(parents=True, exist_ok=True)
    if with_headroom:
        (custom_nodes / PACKAGE_DIR_NAME).symlink_to(REPO_ROOT, target_is_directory=True)
    port = free_port()
    command = [
        sys.executable, str(COMFYUI_PATH / "main.py"),
        "--cpu", "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base_dir),
        "--disable-auto-launch",
        # Its default database lives inside the ComfyUI checkout; keep each server's own.
        "--database-url", f"sqlite:///{base_dir / 'comfyui.db'}",
        *extra_args,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", "2")
    log_path = base_dir / "comfyui.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=base_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, preexec_fn=_end_with_parent)
    server = ComfyServer(process, port, base_dir, log_path)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory) -> ComfyServer:
    """One real ComfyUI server with Headroom installed, shared by the test session."""
    with start_comfy_server(tmp_path_factory.mktemp("comfy-server"), with_headroom=True) as server:
        yield server
