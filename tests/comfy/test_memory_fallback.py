"""The driver's system-memory fallback said through the real nodes (tiny sd15, in-process ComfyUI, CPU).

The one fake: nodes/bridge/memory_fallback.read_device, the module-level reader of device memory, replaced to give
recorded readings of a CUDA card that spills (on the CPU the real reader reads nothing). Everything else is real:
the training nodes, the run, its memory record on disk, the report nodes, the log.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_train_lora_nodes import _data, _init

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

GIB = 2**30
CARD = 8 * GIB
# Reserved GiB after each step: step 3 reserves more than the 8 GiB card has, and it stays past it.
SPILLING = [6.0, 7.5, 8.4, 8.6, 8.6, 8.6, 8.6, 8.6]


@pytest.fixture
def spilling_card(monkeypatch):
    """The recorded readings, one per call; yields the devices the reader was asked about. Runs this test
    found are forgotten after it (the VRAM monitor lists the runs of the process)."""
    from headroom.nodes.bridge import memory_fallback

    asked, readings = [], iter(SPILLING)

    def recorded(device):
        asked.append(device)
        reserved = int(next(readings) * GIB)
        return reserved, int(reserved * 0.9), CARD

    monkeypatch.setattr(memory_fallback, "read_device", recorded)
    known = dict(memory_fallback.FOUND)
    yield asked
    memory_fallback.FOUND.clear()
    memory_fallback.FOUND.update(known)


def _said(text: str) -> bool:
    return "spilling into system RAM" in text and "Prefer No Sysmem Fallback" in text and "vram_budget_gb" in text


def test_the_real_reader_reads_nothing_on_a_cpu(comfyui):
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.memory_fallback import read_device

    assert read_device(torch.device("cpu")) is None
    model, _, _, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "fallback_cpu", rank=4)
    with torch.inference_mode():
        output = T.HeadroomTrainSteps.execute(run, 2)
    assert "text" not in output.ui and run.memory.warnings == []


def test_train_steps_says_the_spill_once_in_its_text_log_and_record(comfyui, spilling_card, caplog):
    from headroom.nodes import train_lora as T
    from headroom.nodes.monitor import HeadroomMemoryReport, HeadroomVRAMMonitor
    from headroom.training.memory.memory_stats import PhaseRecorder

    model, _, _, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "fallback_spill", rank=4)
    with torch.inference_mode(), caplog.at_level("WARNING"):
        first = T.HeadroomTrainSteps.execute(run, 4)
        later = T.HeadroomTrainSteps.execute(run, 6)  # still spilling: not said again
    assert spilling_card == [run.memory.device] * 6  # one reading per step, of the run's device
    [text] = first.ui["text"]
    assert _said(text) and "at step 3 PyTorch holds 8.40 GiB but the card has 8.00 GiB" in text
    assert "text" not in later.ui
    logged = [record for record in caplog.records if "spilling into system RAM" in record.getMessage()]
    assert len(logged) == 1 and logged[0].levelname == "WARNING" and "fallback_spill" in logged[0].getMessage()

    # Kept in the run's memory record, on disk too, and shown by the Memory Report node after the run.
    [warning] = run.memory.warnings
    assert warning["kind"] == "spill" and warning["step"] == 3 and warning["message"] == text
    on_disk = PhaseRecorder.from_json(run.run_dir.memory_record_path.read_text())
    assert on_disk.warnings == [warning]
    report_text, record_json, _ = HeadroomMemoryReport.execute(run=run).args
    assert f"WARNING: {text}" in report_text and json.loads(record_json)["warnings"] == [warning]
    # And by the VRAM monitor, naming the run (its own reading now is the recorded card, still spilling).
    _, monitor_text, monitor_json = HeadroomVRAMMonitor.execute(value=run, reset_peak=False).result
    found = json.loads(monitor_json)["fallback"]
    assert [f.get("run") for f in found] == [None, "fallback_spill"]
    assert f"WARNING: run 'fallback_spill': {text}" in monitor_text and "now PyTorch holds 8.60 GiB" in monitor_text

    # A run reopened from its folder keeps the warning in its record.
    with torch.inference_mode():
        reopened = _init(model, latents, texts, "fallback_spill", rank=4)
    assert reopened.step == 6 and reopened.memory.warnings == [warning]


def test_the_all_in_one_node_says_it_in_its_text(comfyui, spilling_card):
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _data("sd15", count=2)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
        output = T.HeadroomTrainLora.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="fallback_all_in_one", seed=0, batch_size=2, grad_accumulation=1, precision="fp32",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0,
            steps=4, validate_every=2, save_every=0, lora_subfolder="headroom", clip=None, vae=None, prompts="",
            negative="", sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="simple",
            width=32, height=32, loss_timesteps=1)
    said = [text for text in output.ui["text"] if _said(text)]
    assert len(said) == 1 and "at step 3" in said[0]
