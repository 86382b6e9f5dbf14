"""Worker processes for the check and the fuzz, sharing one compilation cache.

On a GPU, ``python -m jdet check`` and its ``--trials`` fuzz spend most of their
time compiling, and XLA compiles one program on mostly one core. Independent
jobs (check cases, fuzz trial shards) therefore run in worker processes, one
compile per core. The workers share a persistent compilation cache, so that a
program one worker compiled loads in the others: the user's
``JAX_COMPILATION_CACHE_DIR`` if set, else a temporary folder for the run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import shutil
import tempfile
from typing import Iterator


MAX_DEFAULT_WORKERS = 8  # each holds a CUDA context and its cases' inputs on the one GPU


def default_workers() -> int:
  """Worker processes on this machine: one per two cores on a GPU (each worker
  also compiles on a second thread), at most ``MAX_DEFAULT_WORKERS``; none on a
  CPU, where interpret-mode kernels call back into Python and XLA:CPU already
  uses every core."""
  import jax
  if jax.default_backend() != "gpu":
    return 1
  return max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 2) // 2))


def _start_worker(cache_dir: str | None) -> None:
  import jax
  from jdet.testing import synchronous_cpu_dispatch
  synchronous_cpu_dispatch()
  if cache_dir is not None:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# What the workers inherit. Their host BLAS (float64 references) stays on one
# thread: with one OpenBLAS thread pool per core in every worker, the H100 host's 16
# cores ran hundreds of spinning threads and small float64 products took minutes.
# And they share one GPU, so none may preallocate most of its memory.
WORKER_ENVIRONMENT = {**{name: "1" for name in
                         ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
                      "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
  """``os.environ`` updated with ``variables`` (what spawned processes inherit) for
  the block; restored after."""
  saved = {name: os.environ.get(name) for name in variables}
  os.environ.update(variables)
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[concurrent.futures.ProcessPoolExecutor]:
  """A pool of ``workers`` fresh (spawned) processes that share a compilation cache.

  The calling process should not hold most of the GPU's memory: ``python -m jdet``
  turns jax's preallocation off unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` is set."""
  import jax
  user_cache = jax.config.jax_compilation_cache_dir
  cache_dir = user_cache or tempfile.mkdtemp(prefix="jdet-compilation-cache-")
  try:
    with _environment(WORKER_ENVIRONMENT), concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker, initargs=(None if user_cache else cache_dir,)) as pool:
      yield pool
  finally:
    if not user_cache:
      shutil.rmtree(cache_dir, ignore_errors=True)
