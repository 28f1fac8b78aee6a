"""The GPU kernel tests' random generator: a fresh seed per test, printed in failure messages."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.gpu_common import DEVICE


@pytest.fixture
def gen():
    seed = random.SystemRandom().randrange(1 << 31)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return g
