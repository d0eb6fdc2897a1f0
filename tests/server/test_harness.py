"""The package inside a real ComfyUI: in-process, as a server subprocess, and driven headless
(workflows/headroom_run.py and comfy-cli's `comfy run`)."""
import asyncio
import io
import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from headroom.workflows.headroom_run import format_train_step
from PIL import Image
from server_harness import HANG_LIMIT_S, WorkflowError, start_comfy_server

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADROOM_RUN = REPO_ROOT / "workflows" / "headroom_run.py"
DEMO_WORKFLOW = REPO_ROOT / "workflows" / "api" / "demo_tiny_api.json"
TINY_LORA_WORKFLOW = REPO_ROOT / "workflows" / "api" / "tiny_lora_api.json"
FAMILIES = ["sd15", "sd3", "flux", "flux2"]


def headroom_node_ids(headroom_nodes) -> set[str]:
    node_classes = asyncio.run(headroom_nodes.HeadroomExtension().get_node_list())
    return {cls.define_schema().node_id for cls in node_classes}


def image_size(server, file: dict) -> tuple[int, int]:
    return Image.open(io.BytesIO(server.view(**file))).size


def run_headroom_run(server, workflow: dict, tmp_path, *extra_args, timeout=300) -> subprocess.CompletedProcess:
    workflow_path = tmp_path / "workflow_api.json"
    workflow_path.write_text(json.dumps(workflow))
    command = [sys.executable, str(HEADROOM_RUN), str(workflow_path), "--port", str(server.port),
               *extra_args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


def stock_image_workflow(width: int = 64) -> dict:
    """Stock nodes only, no model file, deterministic."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": width, "height": 48, "batch_size": 1, "color": 0xFF4010}},
        "2": {"class_type": "ImageBlur", "inputs": {"image": ["1", 0], "blur_radius": 3, "sigma": 1.5}},
        "3": {"class_type": "ImageInvert", "inputs": {"image": ["2", 0]}},
        "4": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": width, "height": 48}},
        "5": {"class_type": "MaskToImage", "inputs": {"mask": ["4", 0]}},
        "6": {"class_type": "ImageBlend", "inputs": {"image1": ["3", 0], "image2": ["5", 0], "blend_factor": 0.5,
                                                       "blend_mode": "multiply"}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "stock/check"}},
    }


def tiny_sampling_workflow(family: str, steps: int = 4) -> dict:
    empty = {"sd3": "EmptySD3LatentImage", "flux": "EmptySD3LatentImage", "flux2": "EmptyFlux2LatentImage"}
    latent = {"class_type": empty.get(family, "EmptyLatentImage"), "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    return {
        "1": {"class_type": "HeadroomTinyModel", "inputs": {"family": family, "seed": 0}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle at the center", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": latent,
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "seed": 0, "steps": steps, "cfg": 1.0 if family == "flux" else 4.0,
            "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0},
            "_meta": {"title": "Sampler"}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": f"tiny/{family}"}},
    }


@pytest.mark.comfyui
def test_in_process_comfyui_is_on_cpu_and_lists_headroom_nodes(comfyui, headroom_nodes):
    import comfy.model_management

    assert comfy.model_management.cpu_state == comfy.model_management.CPUState.CPU
    assert comfy.model_management.get_torch_device().type == "cpu"
    node_ids = headroom_node_ids(headroom_nodes)
    assert node_ids, "HeadroomExtension lists no nodes"
    assert all(node_id.startswith("Headroom") for node_id in node_ids), node_ids


@pytest.mark.server
def test_server_lists_every_headroom_node_and_logs_no_error(comfy_server, headroom_nodes):
    expected = headroom_node_ids(headroom_nodes)
    listed = {name for name in comfy_server.object_info() if name.startswith("Headroom")}
    assert listed == expected

    startup_log = comfy_server.startup_log
    assert "Traceback" not in startup_log, startup_log
    failed = [line for line in startup_log.splitlines() if "IMPORT FAILED" in line and "comfyui-headroom" in line]
    assert not failed, startup_log
    assert "Error while calling comfy_entrypoint" not in startup_log, startup_log


@pytest.mark.server
def test_stock_nodes_are_unchanged_by_the_package(tmp_path):
    # Two fresh servers: the shared one's model folders fill up with files other tests save, which
    # would change stock loaders' file lists for reasons that have nothing to do with the package.
    with start_comfy_server(tmp_path / "headroom-base", with_headroom=True) as headroom_server:
        with_headroom = headroom_server.run_workflow(stock_image_workflow())
        headroom_info = headroom_server.object_info()
        pixels = np.asarray(Image.open(io.BytesIO(headroom_server.view(**with_headroom.files()[0]))))
    with start_comfy_server(tmp_path / "stock-base", with_headroom=False) as stock_server:
        stock = stock_server.run_workflow(stock_image_workflow())
        stock_info = stock_server.object_info()
        stock_pixels = np.asarray(Image.open(io.BytesIO(stock_server.view(**stock.files()[0]))))

    assert pixels.shape == (48, 64, 3)
    np.testing.assert_array_equal(pixels, stock_pixels)

    assert not any(name.startswith("Headroom") for name in stock_info)
    for name, definition in stock_info.items():
        assert headroom_info.get(name) == definition, f"stock node {name} is defined differently with Headroom loaded"


@pytest.mark.server
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_samples_through_stock_ksampler(comfy_server, family):
    execution = comfy_server.run_workflow(tiny_sampling_workflow(family), timeout=300)

    [file] = execution.files()
    assert comfy_server.output_path(file).is_file()
    assert image_size(comfy_server, file) == (64, 64)


@pytest.mark.server
def test_run_workflow_raises_comfyui_error_text(comfy_server):
    broken = {"1": {"class_type": "ComfyMathExpression", "inputs": {"expression": "a / 0", "values.a": 1.0}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    with pytest.raises(WorkflowError, match=r"node 1 \(ComfyMathExpression\) failed: ZeroDivisionError"):
        comfy_server.run_workflow(broken)
    with pytest.raises(WorkflowError, match="NoSuchNode"):
        comfy_server.queue({"1": {"class_type": "NoSuchNode", "inputs": {}}})


@pytest.mark.server
def test_headroom_run_succeeds_and_applies_set(comfy_server, tmp_path):
    result = run_headroom_run(comfy_server, stock_image_workflow(), tmp_path,
                              "--set", "1.width=32", "--set", "SolidMask.width=32", "--set", "7.filename_prefix=cli/run")

    assert result.returncode == 0, result.stdout + result.stderr
    output_lines = [line for line in result.stdout.splitlines() if line.startswith("output: ")]
    assert len(output_lines) == 1, result.stdout
    relative_path = output_lines[0].split()[1]
    assert relative_path.startswith("output/cli/run_")
    assert Image.open(comfy_server.base_dir / relative_path).size == (32, 48)


@pytest.mark.server
def test_headroom_run_prints_progress_saved_files_and_notes_with_or_without_websocket(comfy_server, tmp_path):
    """The demo workflow headless: training progress lines, the saved LoRA (relative to ComfyUI's models/ folder)
    and validation grid, previews marked temporary. Then without websocket-client: a warning, polling lines, the
    same summary, and the note that lowering steps trained nothing."""
    run_name = f"cli_{time.time_ns()}"
    workflow = json.loads(TINY_LORA_WORKFLOW.read_text())
    set_run = ["--set", f"HeadroomTrainLoraInit.run_name={run_name}"]
    result = run_headroom_run(comfy_server, workflow, tmp_path, *set_run, "--set", "HeadroomTrainSteps.steps=4",
                              timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.strip().startswith("step 4/4  loss ") for line in lines), result.stdout
    lora = f"models/loras/headroom/{run_name}_step000004.safetensors"
    grid = f"output/headroom_runs/{run_name}/validation/step_00000004.png"
    assert f"saved LoRA: {lora}" in lines and f"saved validation grid: {grid}" in lines, result.stdout
    assert (comfy_server.base_dir / lora).is_file() and (comfy_server.base_dir / grid).is_file()
    # compare_base is on: Validate shows its before/after grid (an output file) on the node, not temporary previews
    before_after = f"output/headroom_runs/{run_name}/validation/step_00000004_before_after.png"
    assert f"saved before/after grid: {before_after}" in lines, result.stdout
    assert all(line.startswith("preview (temporary): temp/") for line in lines if "temp/" in line), result.stdout

    without_websocket = ("import runpy, sys; sys.modules['websocket'] = None; sys.argv = sys.argv[1:]; "
                         "runpy.run_path(sys.argv[0], run_name='__main__')")
    workflow_path = tmp_path / "workflow_api.json"  # written by run_headroom_run above
    result = subprocess.run(
        [sys.executable, "-c", without_websocket, str(HEADROOM_RUN), str(workflow_path), "--port",
         str(comfy_server.port), *set_run, "--set", "HeadroomTrainSteps.steps=3"],
        check=False, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "websocket-client is not installed" in result.stderr and "pip install websocket-client" in result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith(("queued (", "running (")) for line in lines), result.stdout
    assert any(line.startswith(f"note: Train LoRA: Steps (Headroom): run '{run_name}' is at step 4, past steps=3") for line in lines)
    assert f"saved LoRA: {lora}" in lines, result.stdout


@pytest.mark.server
def test_headroom_run_fails_with_comfyui_error_text(comfy_server, tmp_path):
    failing = {"1": {"class_type": "ComfyMathExpression", "inputs": {"expression": "a / 0", "values.a": 1.0}},
               "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    result = run_headroom_run(comfy_server, failing, tmp_path)
    assert result.returncode == 1
    assert "node 1 (ComfyMathExpression) failed: ZeroDivisionError" in result.stderr

    rejected = {"1": {"class_type": "NoSuchNode", "inputs": {}}}
    result = run_headroom_run(comfy_server, rejected, tmp_path)
    assert result.returncode == 1
    assert "ComfyUI rejected the workflow" in result.stderr and "NoSuchNode" in result.stderr

    result = run_headroom_run(comfy_server, stock_image_workflow(), tmp_path, "--set", "Nowhere.width=3")
    assert result.returncode == 2
    assert "Nowhere" in result.stderr


@pytest.mark.server
def test_headroom_run_ctrl_c_interrupts_and_leaves_comfyui_idle(comfy_server, tmp_path):
    workflow_path = tmp_path / "long_api.json"
    workflow_path.write_text(json.dumps(tiny_sampling_workflow("sd15")))
    process = subprocess.Popen(
        [sys.executable, str(HEADROOM_RUN), str(workflow_path), "--port", str(comfy_server.port),
         "--set", "Sampler.steps=10000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl+C as a terminal delivers it: a suite started in the background by a non-interactive shell inherits
        # SIGINT ignored, and Python installs no KeyboardInterrupt handler then (the run sampled all 10,000 steps)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not comfy_server.queue_state()["queue_running"]:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the long prompt never started"
            time.sleep(0.2)
        time.sleep(2)  # well inside the sampling loop by now
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=HANG_LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()

    assert process.returncode == 130, stdout + stderr
    assert "no longer queued or running" in stderr
    state = comfy_server.queue_state()
    assert state["queue_running"] == [] and state["queue_pending"] == []
    prompt_id = stdout.split("as prompt ", 1)[1].split()[0]
    messages = [event for event, _ in comfy_server.history(prompt_id)["status"]["messages"]]
    assert "execution_interrupted" in messages


@pytest.mark.server
def test_demo_workflow_runs_with_comfy_cli(comfy_server):
    comfy = pathlib.Path(sys.executable).with_name("comfy")
    if not comfy.exists():
        pytest.skip("comfy-cli is not installed in this environment (pip install comfy-cli)")
    result = subprocess.run(
        [str(comfy), "--skip-prompt", "run", "--workflow", str(DEMO_WORKFLOW), "--wait",
         "--host", "127.0.0.1", "--port", str(comfy_server.port), "--timeout", str(int(HANG_LIMIT_S))],
        check=False, capture_output=True, text=True, timeout=HANG_LIMIT_S + 60)

    assert result.returncode == 0, result.stdout + result.stderr
    images = sorted((comfy_server.base_dir / "output" / "headroom_demo").glob("tiny_*.png"))
    assert images, result.stdout
    assert Image.open(images[-1]).size == (64, 64)


def test_train_step_line_shows_loss_lr_speed_and_memory():
    line = format_train_step({"step": 5, "total_steps": 100, "loss": 0.123456, "lr": 1e-4, "s_per_step": 0.5,
                              "eta_s": 47.5, "allocated": 512 * 2**20, "reserved": 1024 * 2**20})
    assert line == "step 5/100  loss 0.1235  lr 1.00e-04  0.50s/step  ETA 48s  VRAM alloc 512MB reserved 1024MB"
    assert format_train_step({"step": 3}) == "step 3"


def test_progress_lines_overwrite_without_escapes_and_odd_characters_do_not_stop_the_command():
    """On a terminal each progress line goes over the one before with a carriage return and spaces (Windows' console
    prints the erase-line escape as text); redirected into a Windows code page (cp1252 here), characters it lacks
    are shown as '?' instead of ending headroom_run with a UnicodeEncodeError."""
    from headroom.workflows.headroom_run import ProgressPrinter, main

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    printer = ProgressPrinter({"7": {"class_type": "HeadroomTrainLora", "_meta": {"title": "Train"}}}, terminal)
    printer({"type": "headroom.train.step", "data": {"node": "7", "step": 1, "total_steps": 3, "loss": 0.123456}})
    printer({"type": "headroom.train.step", "data": {"node": "7", "step": 2, "total_steps": 3}})
    printer({"type": "headroom.train.step", "data": {"node": "7", "step": 3, "total_steps": 3}})
    shown = terminal.getvalue()
    assert "\033" not in shown
    assert shown == "\r  step 1/3  loss 0.1235\r  step 2/3" + " " * 13 + "\r  step 3/3\n"

    raw = io.BytesIO()
    code_page = io.TextIOWrapper(raw, encoding="cp1252")
    real = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = code_page
    try:
        assert main(["/nonexistent/Zeichnung \u2192 \u732b.json"]) != 0  # an error naming the path: printed
        code_page.flush()
    finally:
        sys.stdout, sys.stderr = real
    assert "Zeichnung ? ?" in raw.getvalue().decode("cp1252")
