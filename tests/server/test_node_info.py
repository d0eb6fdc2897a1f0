"""What the editor shows of every Headroom node, read from a real server's /object_info: a tooltip on every
input and output (as stock nodes have), one display-name convention, dataset nodes in one category."""
import pytest

DATA_NODES = {"HeadroomSyntheticDataset", "HeadroomDatasetFromFolder", "HeadroomDatasetFromImages",
              "HeadroomPreviewDataset"}


@pytest.fixture(scope="module")
def headroom_info(comfy_server) -> dict:
    """/object_info entries of the nodes this package registered (by the module ComfyUI loaded them from)."""
    info = comfy_server.object_info()
    ours = {name: node for name, node in info.items() if "comfyui-headroom" in str(node.get("python_module"))}
    assert len(ours) >= 20 and all(name.startswith("Headroom") for name in ours), sorted(ours)
    return ours


def test_every_input_and_output_has_a_tooltip(headroom_info):
    missing = []
    for name, node in sorted(headroom_info.items()):
        for section in ("required", "optional"):
            for input_name, spec in node["input"].get(section, {}).items():
                options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                if not str(options.get("tooltip") or "").strip():
                    missing.append(f"{name} input {input_name}")
        tooltips = node.get("output_tooltips") or [None] * len(node["output"])
        assert len(tooltips) == len(node["output"]), name
        missing += [f"{name} output {output}" for output, tooltip in zip(node["output_name"], tooltips)
                    if not str(tooltip or "").strip()]
    assert missing == [], f"{len(missing)} without a tooltip:\n" + "\n".join(missing)


def test_display_names_and_categories_follow_one_convention(headroom_info):
    names = {name: node["display_name"] for name, node in headroom_info.items()}
    assert [n for n, display in names.items() if not display.endswith(" (Headroom)")] == [], names
    assert [n for n, display in names.items() if display.startswith("Headroom")] == [], names
    categories = {name: node["category"] for name, node in headroom_info.items()}
    assert {categories[name] for name in DATA_NODES} == {"Headroom/data"}, categories
    assert all(category.startswith("Headroom/") for category in categories.values()), categories


def test_default_resolutions_agree(headroom_info):
    """The nodes a user wires together start at one size (SD1.5's native 512), so the defaults never rescale
    the dataset or sample at a size it was not trained at."""
    def default(node: str, name: str) -> int:
        spec = {**headroom_info[node]["input"].get("required", {}), **headroom_info[node]["input"].get("optional", {})}
        return spec[name][1]["default"]

    defaults = {(node, name): default(node, name) for node, name in [
        ("HeadroomSyntheticDataset", "resolution"), ("HeadroomDatasetFromImages", "resolution"),
        ("HeadroomDatasetFromFolder", "resolution"), ("HeadroomValidate", "width"), ("HeadroomValidate", "height"),
        ("HeadroomTrainLora", "width"), ("HeadroomTrainControlNet", "height")]}
    assert set(defaults.values()) == {512}, defaults


def test_errors_name_a_clean_exception_type(comfy_server):
    """ComfyUI names an exception's type module + "." + class, and imports a custom node package under its
    folder path: our own exception types must not show that path."""
    prompt = {"1": {"class_type": "HeadroomDatasetFromFolder",
                    "inputs": {"folder": "no_such_dataset", "control_folder": "", "resolution": 64, "step": 64,
                               "crop": "center", "flip": False, "seed": 0, "skip_bad": False}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    execution = comfy_server.wait(comfy_server.queue(prompt), timeout=120)
    assert execution.status == "error", execution
    assert execution.error["exception_type"] == "headroom.training.data.dataset.DatasetError", execution.error
    assert "no_such_dataset" in execution.error["exception_message"]
