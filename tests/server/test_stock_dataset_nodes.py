"""ComfyUI's own dataset nodes feeding Headroom on a real server: the image and text lists of Load Image-Text (from
Folder) (one [1, H, W, 3] per image, sizes differing), through a stock list node (Shuffle Pairs of Image-Text),
into Dataset From Images, which takes the lists whole (one dataset, not one per image) and keeps each caption with
its image; Preview Dataset shows the result."""
import re
import uuid

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.server

SIZES = {"wide": (96, 48), "tall": (48, 96), "square": (64, 64)}


def test_the_lists_of_comfyuis_dataset_nodes_make_one_dataset_with_each_caption_on_its_image(comfy_server):
    folder = f"stock_lists_{uuid.uuid4().hex[:6]}"
    root = comfy_server.base_dir / "input" / folder
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, (width, height) in SIZES.items():
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"a {name} picture", encoding="utf-8")
    prompt = {
        "1": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": folder}},
        "2": {"class_type": "ShuffleImageTextDataset", "inputs": {"images": ["1", 0], "texts": ["1", 1], "seed": 3}},
        "3": {"class_type": "HeadroomDatasetFromImages",
              "inputs": {"images": ["2", 0], "captions": ["2", 1], "resolution": 64, "step": 16, "crop": "center",
                         "flip": False, "seed": 0, "trigger_word": "ohwx"}},
        "4": {"class_type": "HeadroomPreviewDataset", "inputs": {"dataset": ["3", 0], "count": 16, "start": 0,
                                                                 "show_masks": True}},
    }
    execution = comfy_server.run_workflow(prompt, timeout=300)
    preview = execution.outputs["4"]
    [text] = preview["text"]
    lines = text.splitlines()
    assert lines[0] == "items 0-2 of 3, at resolution 64:", text  # one dataset of all three, not three of one
    assert len(preview["images"]) == 3
    seen = {}
    for line in lines[1:]:
        match = re.fullmatch(r"\d: image \d \((\d+)x(\d+)\): ohwx, a (\w+) picture", line)
        assert match, line
        width, height, name = int(match[1]), int(match[2]), match[3]
        seen[name] = (width, height)
    # Each caption stayed with its own image: the wide one's bucket is wide, the tall one's tall.
    assert set(seen) == set(SIZES)
    assert seen["wide"][0] > seen["wide"][1] and seen["tall"][0] < seen["tall"][1] and seen["square"] == (64, 64)
