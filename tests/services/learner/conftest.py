"""Learner tests: torch on one thread.

The development machine has 2 cores shared by several test runs; OpenMP threads that
spin-wait for each other there make torch 3-5x slower than a single thread.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
