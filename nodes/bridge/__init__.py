"""The bridge between ComfyUI's objects and the engine (training/): the run, the MODEL as a denoiser, placement,
planning, validation, saved files, the family registry. No node classes here; nodes/ imports this, never the
reverse (docs/ARCHITECTURE.md)."""
