#!/usr/bin/env python3
"""Run an API-format workflow on a running ComfyUI and follow it in the terminal.

    python workflows/headroom_run.py WORKFLOW_API.json [--host 127.0.0.1] [--port 8188]
        [--set NODE.input=VALUE ...] [--timeout SECONDS]

NODE is a node id, a node title (`_meta.title`) or a class type that occurs once. VALUE is read as
JSON when it parses (numbers, true/false, lists), else as a plain string. Progress comes from
ComfyUI's websocket: node progress bars and Headroom's `headroom.train.step` events (loss, lr,
speed, memory). At the end it lists what was saved (LoRA / ControlNet files relative to ComfyUI's
models/ folder, validation grids under output/), then the other output files and temporary previews.
Exit status: 0 success, 1 the workflow failed (ComfyUI's error text is printed), 2 bad arguments or
workflow file, 3 ComfyUI unreachable, 124 timeout, 130 Ctrl-C (the prompt is taken off the queue /
interrupted first, so ComfyUI is left idle).

Standard library plus `websocket-client` only (no ComfyUI, no torch), so it runs from any Python;
without websocket-client it says so and follows the prompt by polling /queue and /history (a line
every few seconds, no per-step progress). The test harness (tests/server_harness.py) drives its
servers through `ComfyClient` from this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

try:
    import websocket  # websocket-client
except ImportError:  # polling /history still works, only live progress is lost
    websocket = None

TERMINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")
TEXT_EVENT = "progress_text"  # made up here from ComfyUI's binary TEXT frame (protocol.BinaryEventTypes.TEXT = 3):
# {"node", "text"}, the text a node shows while it runs (e.g. the policy a training node fitted to the card)
POLL_EVENT = "headroom_run.poll"  # made up here, without a websocket: {"state": "queued" | "running", "elapsed_s"}
SAVED_KEY = "headroom_saved"  # Headroom nodes' UI output: [{"kind", "folder", "name"}] of the files they saved
HISTORY_KEY = "headroom_history"  # training nodes' UI output; its "note" says why nothing was trained
NO_WEBSOCKET_WARNING = (
    "warning: the Python package websocket-client is not installed, so there is no live progress (steps, loss);\n"
    "         following the prompt by polling ComfyUI's /queue and /history instead.\n"
    "         For progress lines: pip install websocket-client"
)


class WorkflowError(RuntimeError):
    """ComfyUI rejected or failed a workflow; the message is ComfyUI's own error text."""


@dataclasses.dataclass
class Execution:
    """How one queued prompt ended."""

    prompt_id: str
    status: str  # "success", "error" or "interrupted"
    error: dict | None  # ComfyUI's execution_error / execution_interrupted message data
    outputs: dict  # /history outputs: node id -> that node's UI output
    events: list[dict]  # websocket messages seen while waiting: {"type": ..., "data": ...}

    def ui_entries(self, key: str) -> list:
        """Every node's entries of one UI output key (e.g. "headroom_saved"), in node order."""
        return [item for node_output in self.outputs.values() for item in node_output.get(key) or []]

    def files(self) -> list[dict]:
        """Every output file reference ({"filename", "subfolder", "type"}) in node order."""
        return [
            item
            for node_output in self.outputs.values()
            for items in node_output.values()
            if isinstance(items, list)
            for item in items
            if isinstance(item, dict) and "filename" in item
        ]


def format_validation_error(response: dict) -> str:
    """Text of a POST /prompt rejection: the overall error and each node's errors."""
    error = response.get("error") or {}
    lines = [f"ComfyUI rejected the workflow: {error.get('message', error)}"]
    if error.get("details"):
        lines.append(f"  {error['details']}")
    for node_id, node_error in (response.get("node_errors") or {}).items():
        for item in node_error.get("errors", []):
            detail = f": {item['details']}" if item.get("details") else ""
            lines.append(f"  node {node_id} ({node_error.get('class_type', '?')}): {item.get('message')}{detail}")
    return "\n".join(lines)


def format_execution_error(error: dict) -> str:
    """Text of an execution_error message: node, type, exception and ComfyUI's traceback."""
    lines = [(
        f"node {error.get('node_id')} ({error.get('node_type')}) failed: "
        f"{error.get('exception_type')}: {str(error.get('exception_message', '')).strip()}"
    )]
    traceback = "".join(error.get("traceback") or []).rstrip()
    if traceback:
        lines += ["ComfyUI traceback:", traceback]
    return "\n".join(lines)


class ComfyClient:
    """A ComfyUI server's HTTP API and its websocket, as one small object."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8188):
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.client_id = uuid.uuid4().hex
        self._ws = None

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 60) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    def _get_json(self, path: str):
        return json.loads(self._request("GET", path))

    def object_info(self) -> dict:
        return self._get_json("/object_info")

    def history(self, prompt_id: str) -> dict:
        """The /history entry of a prompt ({} while it is queued or running)."""
        return self._get_json(f"/history/{prompt_id}").get(prompt_id, {})

    def queue_state(self) -> dict:
        return self._get_json("/queue")

    def is_queued_or_running(self, prompt_id: str) -> bool:
        state = self.queue_state()
        return any(item[1] == prompt_id for item in state["queue_running"] + state["queue_pending"])

    def queue(self, prompt: dict) -> str:
        """Submit an API-format prompt; returns its prompt id. Raises WorkflowError if ComfyUI rejects it."""
        # Choosing the id ourselves (and connecting first) means no event of this prompt can be missed.
        self.connect()
        prompt_id = str(uuid.uuid4())
        body = {"prompt": prompt, "client_id": self.client_id, "prompt_id": prompt_id}
        try:
            self._request("POST", "/prompt", body)
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                raise WorkflowError(format_validation_error(json.loads(text))) from None
            except json.JSONDecodeError:
                raise WorkflowError(f"ComfyUI answered {error.code} to POST /prompt: {text}") from None
        return prompt_id

    def interrupt(self, prompt_id: str | None = None) -> None:
        """Interrupt the running prompt (only if it is `prompt_id`, when given)."""
        self._request("POST", "/interrupt", {"prompt_id": prompt_id} if prompt_id else {})

    def delete_queued(self, prompt_id: str) -> None:
        self._request("POST", "/queue", {"delete": [prompt_id]})

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        self._request("POST", "/free", {"unload_models": unload_models, "free_memory": free_memory})

    def view(self, filename: str, subfolder: str = "", type: str = "output") -> bytes:
        """The bytes of an output/temp/input file, as the /view endpoint serves them."""
        query = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        return self._request("GET", f"/view?{query}")

    def view_url(self, file: dict) -> str:
        return f"{self.url}/view?" + urllib.parse.urlencode(
            {"filename": file["filename"], "subfolder": file.get("subfolder", ""), "type": file.get("type", "output")}
        )

    # -- websocket and waiting ----------------------------------------------------------------
    def connect(self) -> None:
        if self._ws is None and websocket is not None:
            ws_url = self.url.replace("http://", "ws://", 1) + f"/ws?clientId={self.client_id}"
            self._ws = websocket.create_connection(ws_url, timeout=30)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def check_server(self) -> None:
        """Called while waiting; a client that owns the server process raises here if it died."""

    def _next_message(self, wait_s: float) -> dict | None:
        self._ws.settimeout(wait_s)
        try:
            frame = self._ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except websocket.WebSocketConnectionClosedException:
            raise ConnectionError("ComfyUI closed the websocket") from None
        if isinstance(frame, bytes):
            return text_event(frame)  # preview images: not needed here (None)
        return json.loads(frame)

    def wait(self, prompt_id: str, timeout: float = 600, on_event=None) -> Execution:
        """Wait until the prompt ends: follow its websocket events up to the terminal one, then read
        the outcome and outputs from /history (polled alone when there is no websocket)."""
        started = time.monotonic()
        deadline = started + timeout
        events: list[dict] = []
        finished = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")
            self.check_server()
            if finished or self._ws is None:
                entry = self.history(prompt_id)
                status = entry.get("status") or {}
                if status.get("completed") or status.get("status_str") == "error":
                    return _execution_from_history(prompt_id, entry, events)
                if not finished and on_event is not None:  # no websocket: where the prompt is, from /queue
                    state = self.queue_state()
                    running = any(item[1] == prompt_id for item in state["queue_running"])
                    on_event({"type": POLL_EVENT, "data": {"prompt_id": prompt_id,
                                                           "state": "running" if running else "queued",
                                                           "elapsed_s": time.monotonic() - started}})
                # ComfyUI writes /history a moment after the terminal event.
                time.sleep(0.1 if finished else 0.5)
                continue
            message = self._next_message(min(1.0, remaining))
            if message is None:
                continue
            data = message.get("data") or {}
            if data.get("prompt_id", prompt_id) != prompt_id:
                continue  # another prompt's event
            events.append(message)
            if on_event is not None:
                on_event(message)
            if message.get("type") in TERMINAL_EVENTS:
                finished = True

    def run_workflow(self, prompt: dict, timeout: float = 600, on_event=None) -> Execution:
        """Queue, wait, and raise WorkflowError with ComfyUI's error text unless it succeeded."""
        execution = self.wait(self.queue(prompt), timeout, on_event)
        if execution.status == "error":
            raise WorkflowError(format_execution_error(execution.error or {}))
        if execution.status == "interrupted":
            raise WorkflowError(f"prompt {execution.prompt_id} was interrupted")
        return execution


def text_event(frame: bytes) -> dict | None:
    """A binary websocket frame as a TEXT_EVENT: ComfyUI's send_progress_text packs the event type (>I), the node id's
    length (>I), the node id and the text. None for other binary frames (preview images)."""
    if len(frame) < 8 or int.from_bytes(frame[:4], "big") != 3:
        return None
    length = int.from_bytes(frame[4:8], "big")
    node, text = frame[8:8 + length], frame[8 + length:]
    return {"type": TEXT_EVENT, "data": {"node": node.decode("utf-8", "replace"), "text": text.decode("utf-8", "replace")}}


def _execution_from_history(prompt_id: str, entry: dict, events: list[dict]) -> Execution:
    status, error = "success", None
    for event, data in entry.get("status", {}).get("messages", []):
        if event == "execution_error":
            status, error = "error", data
        elif event == "execution_interrupted":
            status, error = "interrupted", data
    if status == "success" and entry["status"].get("status_str") == "error":
        status = "error"
    return Execution(prompt_id, status, error, entry.get("outputs", {}), events)


# -- the command ------------------------------------------------------------------------------
def load_api_workflow(path: pathlib.Path) -> dict:
    try:
        workflow = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"cannot read workflow {path}: {error}")
    if "nodes" in workflow and "links" in workflow:
        raise SystemExit(
            f"{path} is a UI-format workflow; export it in API format (Workflow > Export (API)) "
            "or use its *_api.json sibling"
        )
    if not workflow or not all(isinstance(node, dict) and "class_type" in node for node in workflow.values()):
        raise SystemExit(f"{path} is not an API-format workflow (a dict of node id -> {{class_type, inputs}})")
    return workflow


def find_node(workflow: dict, name: str) -> str:
    """Node id for a node id, a unique title, or a unique class type."""
    if name in workflow:
        return name
    for key in (lambda node: node.get("_meta", {}).get("title"), lambda node: node["class_type"]):
        matches = [node_id for node_id, node in workflow.items() if key(node) == name]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise SystemExit(f"--set {name}: matches nodes {', '.join(matches)}; use a node id")
    known = ", ".join(f"{node_id} ({node.get('_meta', {}).get('title', node['class_type'])})" for node_id, node in workflow.items())
    raise SystemExit(f"--set {name}: no node with that id, title or class type; nodes: {known}")


def apply_overrides(workflow: dict, assignments: list[str]) -> None:
    for assignment in assignments:
        target, sep, raw_value = assignment.partition("=")
        node_name, dot, input_name = target.rpartition(".")
        if not sep or not dot or not node_name or not input_name:
            raise SystemExit(f"--set {assignment!r}: expected NODE.input=VALUE")
        node = workflow[find_node(workflow, node_name)]
        try:
            value = json.loads(raw_value)
        except json.JSONDecodeError:
            value = raw_value
        if input_name not in node.setdefault("inputs", {}):
            print(f"note: node {node_name} had no input {input_name!r} in the file; setting it anyway", file=sys.stderr)
        node["inputs"][input_name] = value


def _megabytes(value) -> str:
    return f"{value / 2**20:.0f}MB" if isinstance(value, (int, float)) else "-"


def format_train_step(data: dict) -> str:
    """One progress line from a `headroom.train.step` event."""
    parts = [f"step {data.get('step', '?')}" + (f"/{data['total_steps']}" if data.get("total_steps") else "")]
    if isinstance(data.get("loss"), (int, float)):
        parts.append(f"loss {data['loss']:.4f}")
    if isinstance(data.get("lr"), (int, float)):
        parts.append(f"lr {data['lr']:.2e}")
    if isinstance(data.get("s_per_step"), (int, float)):
        parts.append(f"{data['s_per_step']:.2f}s/step")
    if isinstance(data.get("eta_s"), (int, float)):
        parts.append(f"ETA {data['eta_s']:.0f}s")
    if data.get("allocated") is not None or data.get("reserved") is not None:
        parts.append(f"VRAM alloc {_megabytes(data.get('allocated'))} reserved {_megabytes(data.get('reserved'))}")
    return "  ".join(parts)


class ProgressPrinter:
    """Turns websocket events into terminal lines; progress lines overwrite each other on a tty."""

    POLL_EVERY_S = 10.0  # without a websocket: one "still running" line this often

    def __init__(self, workflow: dict, stream=sys.stdout):
        self.workflow = workflow
        self.stream = stream
        self.tty = stream.isatty()
        self.last_print: dict[str, float] = {}  # per kind of progress line: when it was last printed (not a tty)
        self.training_nodes: set[str] = set()  # nodes that send train steps: their plain progress bar is redundant
        self.last_poll: tuple[str, float] | None = None
        self.open_line = False
        self.open_length = 0  # characters of the progress line shown: a shorter one pads over them

    def _node_name(self, node_id) -> str:
        node = self.workflow.get(str(node_id), {})
        return f"{node_id} ({node.get('_meta', {}).get('title', node.get('class_type', '?'))})"

    def _line(self, text: str) -> None:
        if self.open_line:
            self.stream.write("\n")
            self.open_line, self.open_length = False, 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def _progress(self, text: str, final: bool, kind: str = "progress") -> None:
        if self.tty:
            # "\r" and spaces over the longer line before, not the erase-line escape: Windows' console (conhost)
            # prints escapes as text unless a program turns them on.
            self.stream.write("\r" + text + " " * max(0, self.open_length - len(text)))
            self.open_line, self.open_length = True, len(text)
            if final:  # the line stays; what follows starts below it
                self.stream.write("\n")
                self.open_line, self.open_length = False, 0
            self.stream.flush()
        elif final or time.monotonic() - self.last_print.get(kind, 0.0) >= 1.0:
            self.last_print[kind] = time.monotonic()
            self._line(text)

    def __call__(self, message: dict) -> None:
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "execution_start":
            self._line(f"running prompt {data.get('prompt_id')}")
        elif kind == "execution_cached" and data.get("nodes"):
            self._line(f"cached: {', '.join(self._node_name(n) for n in data['nodes'])}")
        elif kind == "executing" and data.get("node") is not None:
            self._line(f"node {self._node_name(data['node'])}")
        elif kind == "progress" and str(data.get("node")) not in self.training_nodes:
            value, total = data.get("value", 0), data.get("max", 0) or 1
            filled = int(30 * value / total)
            bar = "#" * filled + "-" * (30 - filled)
            self._progress(f"  [{bar}] {value}/{total}", final=value >= total)
        elif kind == "headroom.train.step":
            self.training_nodes.add(str(data.get("node")))
            self._progress("  " + format_train_step(data), final=data.get("step") == data.get("total_steps"),
                           kind=kind)
        elif kind == TEXT_EVENT:
            self._line(f"  {data.get('text')}")
        elif kind == POLL_EVENT:
            state, elapsed = data.get("state"), data.get("elapsed_s", 0.0)
            if self.last_poll is None or state != self.last_poll[0] or elapsed - self.last_poll[1] >= self.POLL_EVERY_S:
                self.last_poll = (state, elapsed)
                self._line(f"{state} ({elapsed:.0f} s)")

    def finish(self) -> None:
        if self.open_line:
            self._line("")


def saved_path(entry: dict) -> str:
    """Where a `headroom_saved` file lies, relative to ComfyUI's folder: models/<folder>/... or output/..."""
    folder = entry.get("folder", "")
    return f"{folder}/{entry.get('name')}" if folder in ("output", "input", "temp") else f"models/{folder}/{entry.get('name')}"


def print_outputs(client: ComfyClient, execution: Execution) -> None:
    """What the run left behind: saved files first (the LoRA / ControlNet a user came for), notes of training
    nodes that trained nothing, then output files and temporary previews."""
    for history in execution.ui_entries(HISTORY_KEY):
        if isinstance(history, dict) and history.get("note"):
            print(f"note: {history['note']}")
    saved = [entry for entry in execution.ui_entries(SAVED_KEY) if isinstance(entry, dict)]
    for entry in saved:
        print(f"saved {entry.get('kind', 'file')}: {saved_path(entry)}")
    files = execution.files()
    for file in files:
        path = "/".join(part for part in (file.get("type", "output"), file.get("subfolder"), file["filename"]) if part)
        label = "preview (temporary)" if file.get("type") == "temp" else "output"
        print(f"{label}: {path}  ({client.view_url(file)})")
    if not files and not saved:
        print("done (the workflow produced no output files)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an API-format ComfyUI workflow and follow its progress.")
    parser.add_argument("workflow", type=pathlib.Path, help="API-format workflow JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="NODE.input=VALUE",
                        help="override an input; NODE is a node id, title or unique class type (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the run (default 3600)")
    args = parser.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        # Node titles, prompts and ComfyUI's errors may hold characters a Windows code page lacks (cp1252 when the
        # output is redirected): shown as "?" rather than a UnicodeEncodeError ending the command.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")

    try:
        workflow = load_api_workflow(args.workflow)
        apply_overrides(workflow, args.assignments)
    except SystemExit as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    client = ComfyClient(args.host, args.port)
    printer = ProgressPrinter(workflow)
    if websocket is None:
        print(NO_WEBSOCKET_WARNING, file=sys.stderr)
    prompt_id = None
    try:
        prompt_id = client.queue(workflow)
        print(f"queued {args.workflow.name} as prompt {prompt_id} on {client.url}")
        execution = client.wait(prompt_id, args.timeout, on_event=printer)
    except WorkflowError as error:
        print(error, file=sys.stderr)
        return 1
    except (urllib.error.URLError, ConnectionError) as error:
        print(f"error: cannot reach ComfyUI at {client.url}: {error}", file=sys.stderr)
        return 3
    except TimeoutError as error:
        printer.finish()
        print(f"error: {error}; the prompt keeps running (Ctrl-C a rerun, or POST /interrupt)", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        printer.finish()
        if prompt_id is not None:
            stop_prompt(client, prompt_id)
        return 130
    finally:
        client.close()

    printer.finish()
    if execution.status == "error":
        print(format_execution_error(execution.error or {}), file=sys.stderr)
        return 1
    if execution.status == "interrupted":
        print(f"prompt {prompt_id} was interrupted (by another client or the UI)", file=sys.stderr)
        return 1
    print_outputs(client, execution)
    return 0


def stop_prompt(client: ComfyClient, prompt_id: str, settle_s: float = 60) -> None:
    """Ctrl-C: take the prompt off the queue, interrupt it if it runs, and wait until ComfyUI lets go
    of it (nodes get to finish their interrupt handling, e.g. save a checkpoint)."""
    print(f"\ninterrupting prompt {prompt_id} ...", file=sys.stderr)
    try:
        client.delete_queued(prompt_id)  # first: a pending prompt must not start after the interrupt
        client.interrupt(prompt_id)
        deadline = time.monotonic() + settle_s
        while client.is_queued_or_running(prompt_id):
            if time.monotonic() > deadline:
                print(f"ComfyUI still holds the prompt after {settle_s:.0f} s; not waiting longer", file=sys.stderr)
                return
            time.sleep(0.25)
        print("interrupted; the prompt is no longer queued or running", file=sys.stderr)
    except KeyboardInterrupt:
        print("second Ctrl-C: not waiting for ComfyUI to stop", file=sys.stderr)
    except (urllib.error.URLError, ConnectionError) as error:
        print(f"could not reach ComfyUI to interrupt: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
