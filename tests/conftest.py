"""Fixtures shared by the suite: the ``gpu`` marker's skip, and the backends to run."""

import importlib.util

import pytest

from jdet.testing import release_compiled_programs, synchronous_cpu_dispatch

synchronous_cpu_dispatch()  # before the first computation: see its docstring

from jdet.bench import on_gpu  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if on_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def _matmul_backends():
  """jdet.matmul's backends that run on this machine: Pallas everywhere (interpret
  mode on CPU), the jax-triton GEMM on an NVIDIA GPU with jax-triton installed."""
  backends = ["pallas"]
  if on_gpu() and importlib.util.find_spec("jax_triton"):
    backends.append("triton")
  return backends


@pytest.fixture(params=_matmul_backends())
def matmul_backend(request):
  return request.param


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Releases compiled programs after each test module (the whole suite's would pass
  vm.max_map_count: it crashed with SIGSEGV in a compile)."""
  yield
  release_compiled_programs()
