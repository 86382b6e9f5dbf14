"""Every registered op on a 4-device data-parallel mesh (CPU host devices, in a
subprocess so the device count of the other tests is unaffected)."""

import os
import subprocess
import sys

import jax
import pytest

from jdet._registry import OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="the host-device mesh is a CPU-only setup")
def test_sharded_rows_equal_single_device():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_check.py")],
                        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for op in OPS:
    assert f"{op}: ok" in proc.stdout, proc.stdout
