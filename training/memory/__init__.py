"""Memory: the offload policy, one module per memory feature (checkpointing, offloaded activations, streamed
weights, low-bit base, optimizer parking), the planner that adds up their costs, memory figures and OOM reports."""
