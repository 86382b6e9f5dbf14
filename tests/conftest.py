import jax
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng():
  return np.random.default_rng(0)
