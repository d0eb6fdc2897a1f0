"""The Headroom engine: pure torch + peft + diffusers utilities + safetensors.

Nothing in this package imports ComfyUI; it is unit-tested on a machine without it.
Modules import each other relatively so the package works both as `<pack>.training`
inside ComfyUI and as `headroom.training` in the test suite.
"""
