"""The training core: the trainer's step and loop, objective and losses, adapters, optimizers, EMA, the run
directory (checkpoints, resume), and the pixel classifier that scores synthetic-shape images."""
