"""Run by tests/test_sharding.py in a subprocess with 4 CPU host devices.

Each registered op (its registry ``sharding_case``) under ``jax.jit`` with a
data-parallel ``NamedSharding`` and inside ``jax.shard_map`` must give every
device's rows bitwise equal to the single-device result. Pallas kernels do not
track varying mesh axes, so ``shard_map`` needs ``check_vma=False`` (as for
jax's own Pallas GPU ops).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jdet._registry import OPS  # noqa: E402
from jdet.testing import assert_bitwise_equal  # noqa: E402


def check(name, fn, x, *shared):
  mesh = Mesh(np.array(jax.devices()), ("data",))
  single = jax.jit(fn)(x, *shared)
  rows = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())
  x_sharded = jax.device_put(x, rows)
  shared_replicated = [jax.device_put(s, replicated) for s in shared]
  out = jax.jit(fn, out_shardings=rows)(x_sharded, *shared_replicated)
  assert len(out.sharding.device_set) == 4, out.sharding
  assert_bitwise_equal(out, single, what=f"{name}: jit with NamedSharding")
  for shard in out.addressable_shards:
    assert_bitwise_equal(shard.data, single[shard.index], what=f"{name}: shard {shard.index}")
  specs = dict(mesh=mesh, in_specs=(P("data"),) + (P(),) * len(shared), out_specs=P("data"),
               check_vma=False)
  mapped = jax.jit(jax.shard_map(fn, **specs))(x_sharded, *shared_replicated)
  assert_bitwise_equal(mapped, single, what=f"{name}: shard_map")
  grad = jax.grad(lambda x, *s: 0.5 * jnp.sum(fn(x, *s).astype(jnp.float32) ** 2))
  assert_bitwise_equal(
      jax.jit(jax.shard_map(grad, **specs))(x_sharded, *shared_replicated),
      jax.jit(grad)(x, *shared), what=f"{name}: per-row gradient under shard_map")
  print(f"{name}: ok")


def main():
  assert len(jax.devices()) == 4, jax.devices()
  rng = np.random.default_rng(0)
  for name, op in OPS.items():
    check(name, *op.sharding_case(rng))
  return 0


if __name__ == "__main__":
  sys.exit(main())
