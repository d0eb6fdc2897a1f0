"""What the folder dataset nodes tell the user on the node itself (issue 44): the items skip_bad left out, and a
caption with no image of its name, which was ignored silently before (its item simply never trained). Through
ComfyUI's own validate_prompt and PromptExecutor, reading the node's UI text as the editor receives it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from comfy_harness import queue_prompt
from PIL import Image

pytestmark = pytest.mark.comfyui

NODE = "Dataset From Folder (Headroom)"
ORPHAN_NOTE = "a caption with no image of the same name; add the image or remove the caption"


@pytest.fixture
def registered(headroom_nodes, monkeypatch):
    """The dataset nodes and ComfyUI's Preview Any (an output node, so the dataset node runs) in ComfyUI's mappings."""
    import nodes
    from comfy_extras.nodes_preview_any import PreviewAny

    from headroom.nodes import cache

    for node in cache.NODES:
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.GET_SCHEMA().node_id, node)
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "PreviewAny", PreviewAny)
    return cache


def _folder(tmp_path, name: str, good: int = 3) -> Path:
    import folder_paths

    folder = Path(folder_paths.get_input_directory()) / f"{name}_{tmp_path.name}"
    folder.mkdir()
    for i in range(good):
        Image.fromarray(np.full((64, 64, 3), 40 * i, np.uint8)).save(folder / f"good{i}.png")
        (folder / f"good{i}.txt").write_text(f"caption {i}")
    return folder


def _broken(folder: Path) -> None:
    """A broken image (with its caption), an unsupported file and a caption whose image is missing."""
    (folder / "broken.png").write_bytes(b"not a png at all")
    (folder / "broken.txt").write_text("a broken one")
    (folder / "notes.pdf").write_bytes(b"%PDF-1.4")
    (folder / "orphan.txt").write_text("its image was renamed")


def _prompt(folder: Path, skip_bad: bool) -> dict:
    return {"1": {"class_type": "HeadroomDatasetFromFolder",
                  "inputs": {"folder": folder.name, "control_folder": "", "resolution": 64, "step": 64,
                             "crop": "center", "flip": False, "seed": 0, "skip_bad": skip_bad}},
            "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}


def _run(prompt: dict):
    """ComfyUI's validation and executor on `prompt`; returns the executor."""
    return queue_prompt(prompt, "notes-run")


def _shown(executor) -> list[str]:
    """The dataset node's UI text, as the editor's headroom_notes.js receives it."""
    assert executor.success, executor.status_messages
    return executor.history_result["outputs"]["1"]["text"]


def test_skip_bad_lists_each_left_out_file_and_the_orphan_caption_on_the_node(registered, tmp_path):
    folder = _folder(tmp_path, "skipped")
    _broken(folder)
    (text,) = _shown(_run(_prompt(folder, skip_bad=True)))
    lines = text.split("\n")
    assert lines[0] == "3 images; 2 left out (skip_bad):", text
    where = f"input/{folder.name}"
    assert lines[1].startswith(f"- {where}/broken.png: unreadable or corrupt image") and "remove it" in lines[1], text
    assert lines[2].startswith(f"- {where}/notes.pdf: unsupported file type '.pdf'") and "move it out" in lines[2], text
    assert lines[3] == "Warning: 1 caption(s) with no image of the same name (not used):", text
    assert lines[4] == f"- {where}/orphan.txt: {ORPHAN_NOTE}", text
    assert len(lines) == 5, text
    # broken.txt belongs to an item that is reported already: not called an orphan too
    assert "broken.txt" not in text

    dataset = registered.HeadroomDatasetFromFolder.execute(folder.name, 64, 64, "center", False, 0, True).args[0]
    assert [item.name for item in dataset.items] == ["good0.png", "good1.png", "good2.png"]
    assert len(dataset.left_out) == 2 and dataset.notes == (f"{where}/orphan.txt: {ORPHAN_NOTE}",)
    assert dataset.warnings[-1] == dataset.notes[0]  # the caching reports list it too


def test_without_skip_bad_the_error_names_every_file_and_the_orphan_caption(registered, tmp_path):
    from headroom.training.data.dataset import DatasetError

    folder = _folder(tmp_path, "refused")
    _broken(folder)
    executor = _run(_prompt(folder, skip_bad=False))
    assert not executor.success
    error = next(data for event, data in executor.status_messages if event == "execution_error")
    message = error["exception_message"]
    assert error["node_id"] == "1" and message.startswith(f"{NODE}: 2 problem(s) in dataset folder"), message
    assert "broken.png: unreadable or corrupt image" in message and "notes.pdf: unsupported file type" in message
    assert "enable skip_bad" in message
    assert f"Also:\n- input/{folder.name}/orphan.txt: {ORPHAN_NOTE}" in message, message
    with pytest.raises(DatasetError, match=r"^Dataset From Folder \(Headroom\): 2 problem\(s\)"):
        registered.HeadroomDatasetFromFolder.execute(folder.name, 64, 64, "center", False, 0, False)


def test_an_orphan_caption_alone_is_a_warning_on_the_node_not_an_error(registered, tmp_path):
    folder = _folder(tmp_path, "orphan")
    (folder / "photo7.txt").write_text("photo7's image was never copied")
    (text,) = _shown(_run(_prompt(folder, skip_bad=False)))
    assert text == (f"3 images.\nWarning: 1 caption(s) with no image of the same name (not used):\n"
                    f"- input/{folder.name}/photo7.txt: {ORPHAN_NOTE}"), text


def test_a_clean_folder_shows_nothing_and_clears_an_earlier_note(registered, tmp_path):
    folder = _folder(tmp_path, "clean")
    assert _shown(_run(_prompt(folder, skip_bad=True))) == []  # an empty text: headroom_notes.js hides the notes


def test_a_long_list_is_cut_to_20_lines_and_says_how_many_more(registered, tmp_path):
    folder = _folder(tmp_path, "many")
    for i in range(25):
        (folder / f"bad{i:02}.png").write_bytes(b"broken")
        (folder / f"bad{i:02}.txt").write_text("x")
    for i in range(23):
        (folder / f"lonely{i:02}.txt").write_text("x")
    (text,) = _shown(_run(_prompt(folder, skip_bad=True)))
    lines = text.split("\n")
    assert lines[0] == "3 images; 25 left out (skip_bad):"
    assert [line for line in lines if "bad" in line and "unreadable" in line] == lines[1:21]
    assert lines[21] == "- ... and 5 more (the server log lists every one)"
    assert lines[22] == "Warning: 23 caption(s) with no image of the same name (not used):"
    assert all("lonely" in line for line in lines[23:43]) and lines[43:] == ["- ... and 3 more (the server log "
                                                                             "lists every one)"]


def test_the_video_dataset_node_reports_captions_with_no_clip(registered, tmp_path):
    """A frame folder's caption is '<folder>.txt', a file's '<stem>.txt': neither is an orphan; a caption matching
    nothing is, shown on the node; a broken clip skip_bad leaves out is listed with the count."""
    import folder_paths

    folder = Path(folder_paths.get_input_directory()) / f"clips_{tmp_path.name}"
    (folder / "walk.v2").mkdir(parents=True)
    for i in range(5):
        Image.fromarray(np.full((64, 64, 3), 30 * i, np.uint8)).save(folder / "walk.v2" / f"{i:03}.png")
    (folder / "walk.v2.txt").write_text("a walk")
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(folder / "still.png")
    (folder / "still.txt").write_text("a still")
    (folder / "broken.mp4").write_bytes(b"not a video")
    (folder / "broken.txt").write_text("broken")
    (folder / "lonely.txt").write_text("no clip")
    prompt = {"1": {"class_type": "HeadroomDatasetFromVideos",
                    "inputs": {"folder": folder.name, "resolution": 64, "step": 16, "crop": "center", "flip": False,
                               "seed": 0, "skip_bad": True, "max_frames": 81, "frame_stride": 1}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    (text,) = _shown(_run(prompt))
    lines = text.split("\n")
    assert lines[0] == "2 clips; 1 left out (skip_bad):", text
    assert lines[1].startswith(f"- input/{folder.name}/broken.mp4: "), text
    assert lines[2:] == ["Warning: 1 caption(s) with no clip or image of the same name (not used):",
                         f"- input/{folder.name}/lonely.txt: a caption with no clip or image of the same name; add "
                         "the clip or remove the caption"], text
