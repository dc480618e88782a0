"""Shared test settings: tiny models run fastest on one thread (and CI has only 2 cores)."""

import torch

torch.set_num_threads(1)
