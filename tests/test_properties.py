"""Seeded random sweep over shapes, dtypes, leading dims and batch splits, every registered op.

Each op's registry ``sweep_case`` draws a shape, splits the flattened batch at a
random point, and asserts that the chunks' results concatenated are bitwise the
full call's, and that the full call is accurate. CPU runs two cases per op (the
fuzz in test_fuzz.py adds transforms and gradients); the GPU sweep more (the
GPU fuzz, ``python -m jdet check --trials``, is where 10^4 random cases per op run).
"""

import numpy as np
import pytest

from jdet._registry import OPS

CPU_CASES, GPU_CASES = 2, 10


@pytest.mark.parametrize("op", sorted(OPS))
def test_random_sweep_cpu(op):
  rng = np.random.default_rng(2026)
  for _ in range(CPU_CASES):
    OPS[op].sweep_case(rng)


@pytest.mark.gpu
@pytest.mark.long
@pytest.mark.parametrize("op", sorted(OPS))
def test_random_sweep_gpu(op):
  rng = np.random.default_rng(11)
  for _ in range(GPU_CASES):
    OPS[op].sweep_case(rng)
