"""Optimizer Config's learning_rate through ComfyUI's own prompt validation and execution (issue 44).

Its min was 1e-8: the editor clamped a typed 0 to it, showed it as 0.000000, and the run trained and saved a LoRA
that changed nothing. Now 0, negative and out-of-range rates are refused naming the node as users see it and what
to set, and a small valid rate reaches the optimizer as it was typed.
"""
from __future__ import annotations

import math

import pytest
from comfy_harness import queue_prompt, validate_prompt

pytestmark = pytest.mark.comfyui

NODE = "Optimizer Config (Headroom)"
INPUTS = {"optimizer": "AdamW", "weight_decay": 0.0, "schedule": "constant", "warmup_steps": 0,
          "schedule_steps": 1000}


@pytest.fixture
def registered(headroom_nodes, monkeypatch):
    """The optimizer node and ComfyUI's Preview Any (an output node that takes any value) in ComfyUI's mappings."""
    import nodes
    from comfy_extras.nodes_preview_any import PreviewAny

    from headroom.nodes.train_lora import HeadroomOptimizerConfig

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "HeadroomOptimizerConfig", HeadroomOptimizerConfig)
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "PreviewAny", PreviewAny)
    return HeadroomOptimizerConfig


def _prompt(learning_rate) -> dict:
    return {"1": {"class_type": "HeadroomOptimizerConfig", "inputs": {**INPUTS, "learning_rate": learning_rate}},
            "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}


def _validate(prompt: dict):
    return validate_prompt(prompt, "lr")


@pytest.mark.parametrize("value,says", [(0.0, "learning_rate 0 trains nothing"),
                                        (-1e-4, "learning_rate -0.0001 is negative"),
                                        (0, "learning_rate 0 trains nothing")],  # an API prompt's integer 0
                         ids=["zero", "negative", "integer-zero"])
def test_a_learning_rate_of_0_or_below_is_refused_naming_the_node_and_what_to_set(registered, value, says):
    valid, error, outputs, node_errors = _validate(_prompt(value))
    assert not valid and list(node_errors) == ["1"], (error, node_errors)
    details = " | ".join(e["details"] for e in node_errors["1"]["errors"])
    # ComfyUI's own range check would have said "Value 0.0 smaller than min of ..." with no advice: it is not used.
    assert "smaller than min" not in details, details
    assert f"{NODE}: {says}" in details, details
    assert "about 1e-4 for a LoRA with AdamW, 1.0 for Prodigy" in details, details

    # The node refuses it too when it runs (a linked value, a call from Python), and the engine's check stays.
    with pytest.raises(ValueError) as refused:
        registered.execute(learning_rate=value, **INPUTS)
    assert str(refused.value).startswith(f"{NODE}: {says}") and "1.0 for Prodigy" in str(refused.value)

    from headroom.training.core.optimizers import OptimizerConfig

    with pytest.raises(ValueError, match="must be > 0"):
        OptimizerConfig(lr=value).validate()


def test_a_rate_above_the_maximum_is_refused_as_comfyui_did_but_saying_what_to_set(registered):
    valid, _, _, node_errors = _validate(_prompt(100.0))
    assert not valid
    details = " | ".join(e["details"] for e in node_errors["1"]["errors"])
    assert f"{NODE}: learning_rate 100 is above 10" in details and "1.0 for Prodigy" in details, details


def test_nan_is_refused_at_validation_naming_the_node(registered):
    valid, _, _, node_errors = _validate(_prompt(math.nan))
    assert not valid
    details = " | ".join(e["details"] for e in node_errors["1"]["errors"])
    assert f"{NODE}: learning_rate=nan is not a finite number" in details, details


@pytest.mark.parametrize("value", [1e-6, 1e-8, 1e-9, 3.5e-7])
def test_a_small_valid_rate_passes_unchanged(registered, value):
    prompt = _prompt(value)
    executor = queue_prompt(prompt, "lr-run")
    assert executor.success, executor.status_messages
    config = registered.execute(learning_rate=value, **INPUTS).args[0]
    assert config.lr == value  # not clamped, not rounded
    shown = executor.history_result["outputs"]["2"]["text"][0]  # Preview Any's text of the config it received
    assert f"lr={value!r}" in shown, shown


def test_the_widget_shows_small_rates_and_lets_0_through_to_the_node(registered):
    """The editor's float widget clamps to min and shows (and rounds to) as many decimals as the step has
    (comfyui_frontend_package: useFloatWidget, precision = -floor(log10(step))): with min 1e-8 a typed 0 became
    1e-8 silently, with step 1e-6 a rate under 5e-7 showed and rounded to 0.000000."""
    spec = registered.GET_NODE_INFO_V1()["input"]["required"]["learning_rate"][1]
    assert spec["min"] == 0.0  # 0 stays 0 in the editor and reaches the node, which refuses it by name
    decimals = max(0, -math.floor(math.log10(spec["step"])))
    assert decimals >= 8
    assert f"{1e-5:.{decimals}f}" == "0.00001000" and float(f"{1e-8:.{decimals}f}") == 1e-8
    assert spec["default"] == 1e-4 and spec["max"] == 10.0
