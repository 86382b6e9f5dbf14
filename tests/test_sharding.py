"""jdet ops on a 4-device data-parallel mesh (CPU host devices, in a subprocess so
the device count of the other tests is unaffected)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ON_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(ON_GPU, reason="the host-device mesh is a CPU-only setup")
def test_sharded_rows_equal_single_device():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_check.py")],
                        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for op in ("matmul", "sinkhorn", "tri_inverse"):
    assert f"{op}: ok" in proc.stdout, proc.stdout
