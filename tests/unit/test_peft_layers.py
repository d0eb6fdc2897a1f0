"""Each adapter kind peft makes is the layer its config describes, on every peft Headroom declares (requirements.txt:
0.13 on; the min_torch venv holds that oldest peft, CI's main venv the newest). peft 0.19 / 0.20 changed how its
layers take their config; before, an unread `config=` made DoRA a plain LoRA and dropped the dropout, silently. peft
0.13's LoKr leaves alpha / rank out of its forward: kind lokr is refused there, naming the upgrade."""
from __future__ import annotations

import sys

import peft
import pytest
import torch
from packaging.version import Version

from headroom.training.checks import MissingPackageError
from headroom.training.core.adapters import AdapterConfig, AdapterSet

pytestmark = pytest.mark.min_torch


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 48)
        self.conv = torch.nn.Conv2d(16, 48, 3, padding=1)


# The trained tensors of each kind (peft's names, as the savers read them).
PARAMETERS = {
    "lora": {"lora_A.default.weight", "lora_B.default.weight"},
    "dora": {"lora_A.default.weight", "lora_B.default.weight", "lora_magnitude_vector.default.weight"},
    "loha": {"hada_w1_a.default", "hada_w1_b.default", "hada_w2_a.default", "hada_w2_b.default"},
    "lokr": {"lokr_w1.default", "lokr_w2.default"},  # rank 4 against factors of 8: peft keeps w2 whole
}


@pytest.mark.parametrize("kind", list(PARAMETERS))
def test_each_kind_is_the_layer_its_config_describes(kind):
    torch.manual_seed(0)
    root = Toy()
    config = AdapterConfig(kind=kind, rank=4, alpha=8.0, dropout=0.25)
    if kind == "lokr" and Version(peft.__version__) < Version("0.14"):  # the min_torch venv's peft 0.13
        with pytest.raises(MissingPackageError, match=r"kind lokr needs the pip package 'peft' 0\.14 or later; this "
                           r"ComfyUI's Python has 0\.13\.\d+, whose LoKr leaves alpha / rank out of its forward .*"
                           r'python -m pip install --upgrade "peft>=0\.14".*or choose kind loha or lora\.$'):
            AdapterSet(root, ["linear", "conv"], config)
        return
    adapters = AdapterSet(root, ["linear", "conv"], config)
    for path, layer in adapters.layers.items():
        trained = {name for name, _ in adapters._own_parameters(layer)}
        assert trained == PARAMETERS[kind], (path, sorted(trained))
        assert layer.r["default"] == 4 and layer.scaling["default"] == pytest.approx(2.0), path
        dropout = layer.lora_dropout["default"] if kind in ("lora", "dora") else None
        if dropout is not None:
            assert isinstance(dropout, torch.nn.Dropout) and dropout.p == 0.25, path
        else:
            assert layer.module_dropout["default"] == 0.25, path
        assert all(p.dtype == torch.float32 and p.requires_grad for _, p in adapters._own_parameters(layer))
    adapters.attach(root)
    root.eval()  # no dropout: an untrained adapter changes nothing
    x, image = torch.randn(2, 64), torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        assert torch.allclose(root.linear(x), root.linear.get_base_layer()(x), atol=1e-6)
        assert torch.allclose(root.conv(image), root.conv.get_base_layer()(image), atol=1e-6)


def test_peft_beside_an_older_accelerate_is_named_before_a_run_and_oft_full_need_no_peft(monkeypatch):
    """peft 0.15+ imports a function accelerate added in 0.32 while declaring accelerate 0.21 or later: in a ComfyUI
    whose other nodes hold accelerate 0.21-0.31, installing Headroom keeps that accelerate and brings the newest peft,
    which does not import (found by hand on ComfyUI's lowest declared packages). A run of a peft kind is refused at
    its start naming both packages and both ways out; kinds oft and full (the pack's own layers) train without peft."""
    from importlib import metadata

    from headroom.training import checks

    real_version, real_import = metadata.version, checks.importlib.import_module
    installed = {"peft": "0.21.2", "accelerate": "0.25.0"}
    monkeypatch.setattr(metadata, "version", lambda name: installed.get(name) or real_version(name))

    def peft_import(name):  # what that pair raises
        if name.startswith("peft") and installed["accelerate"] == "0.25.0":
            raise ImportError("cannot import name 'clear_device_cache' from 'accelerate.utils.memory'",
                              name="accelerate.utils.memory")
        return real_import(name)

    monkeypatch.setattr(checks.importlib, "import_module", peft_import)
    for kind in ("lora", "dora", "loha", "lokr"):
        with pytest.raises(MissingPackageError, match=(
                rf"^kind {kind} needs peft, which does not import here: this ComfyUI's Python has peft 0\.21\.2 and "
                r"accelerate 0\.25\.0, .* added in 0\.32 .* python -m pip install \"accelerate>=0\.32,<1\.16\", or .*"
                r"python -m pip install \"peft==0\.14\.0\" .*then restart ComfyUI; or choose kind oft or full")):
            AdapterSet(Toy(), ["linear", "conv"], AdapterConfig(kind=kind, rank=4, alpha=8.0))
    installed["accelerate"] = "0.32.0"  # the pair that imports: no refusal
    AdapterSet(Toy(), ["linear"], AdapterConfig(kind="lora", rank=4, alpha=8.0))

    monkeypatch.setitem(sys.modules, "peft", None)  # peft does not import at all
    with pytest.raises(MissingPackageError, match=r"^kind lora needs the pip package 'peft', which is not installed"):
        AdapterSet(Toy(), ["linear"], AdapterConfig(kind="lora", rank=4, alpha=8.0))
    full = AdapterSet(Toy(), ["linear"], AdapterConfig(kind="full"))  # (kind oft: ComfyUI's OFTDiff, not peft)
    assert type(full.layers["linear"]).__name__ == "FullLayer"
