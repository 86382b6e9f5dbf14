"""Fixtures shared by the suite: the ``gpu`` marker's skip, and the backends to run."""

import importlib.util
import os

# Under pytest-xdist each worker process would start a host BLAS pool of one thread
# per core, as the check's worker processes did (jdet/_workers.py: there, small
# float64 references took minutes among the spinning threads). Each worker gets its
# share of the cores instead; this runs before anything imports NumPy.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
  for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, str(max(1, (os.cpu_count() or 1)
                                         // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402

from jdet.testing import release_compiled_programs, synchronous_cpu_dispatch  # noqa: E402

synchronous_cpu_dispatch()  # before the first computation: see its docstring

from jdet.bench import on_gpu  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if on_gpu():
    # pytest-xdist hands tests out in this order: the long ones go first, or a long one
    # handed out last would run on alone at the end.
    items.sort(key=lambda item: "long" not in item.keywords)
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
