"""The op registry: one entry per jdet op, read by everything that iterates over ops.

``python -m jdet check`` runs each entry's ``check_cases``, ``python -m jdet bench``
its ``bench_cases`` (``--first-call``: its ``first_call_cases``, the bench cases at
a warm-up size and three sizes nothing else uses, each pass at sizes of its own:
:func:`first_call_cases`), ``tests/test_properties.py`` its
``sweep_case`` and the sharding test (``tests/sharded_check.py``) its
``sharding_case``. Adding an op means writing its module (``jdet/<op>.py`` over
``pallas_kernels/<op>.py``) and one entry here::

    def _my_op_check(full):            # -> list[jdet.check.Case]
      x = random_normal(0, (4096 if full else 16, 512))
      return [Case("my_op", "fwd", jdet.my_op, (x,), (0,),
                   lambda out: relative_error(out, my_op_float64(x)), 1e-6)]

    def _my_op_bench(full):            # -> list[BenchCase]
      ...

    def _my_op_sweep(rng):             # one random invariance + accuracy case; raises on failure
      ...

    def _my_op_sharding(rng):          # -> (fn, batched input, *shared inputs)
      return jdet.my_op, random_normal(rng, (16, 32))

    def _my_op_first_call(full):       # -> list[BenchCase]
      return first_call_cases(lambda m: my_op_bench_cases([(m, 512)]), first_call_sizes(full))

    Op("my_op", _my_op_check, _my_op_bench, _my_op_sweep, _my_op_sharding,
       _my_op_first_call)

and adding it to :data:`OPS`. Every case builder takes ``full`` (production
sizes on a GPU) or a seeded ``rng`` and builds its inputs with
:func:`jdet.testing.random_normal`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jdet
from jdet.bench import BenchCase
from jdet.check import Case
from jdet.testing import assert_bitwise_equal, bits, random_normal, relative_error
from jdet.tri_inverse import gdn_chunk_matrices

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Rows (tokens, query positions) whose error a check case measures against its float64
# reference on the host: rows are independent, and the check's worker processes share
# the host's cores.
REFERENCE_ROWS = 128
# Batch sizes every CPU check case tries besides the whole batch, single rows, padding
# and vmap: each size compiles interpret-mode programs, which is most of the CPU time.
CPU_CHECK_SIZES = (1, 3)
# First-call latency (``python -m jdet bench --first-call``): sizes no other case uses,
# so that every call compiles. The first size warms the process (imports, backend and
# autotuner start-up: its rows read "warm-up call"); the other three are the measured
# first calls. Token counts; matrix counts for tri_inverse; sequence lengths for
# attention and token counts for token_logprobs, whose jnp references hold [T, T]
# scores or [T, V] logits.
FIRST_CALL_TOKENS = (2053, 4099, 8191, 30001)
FIRST_CALL_MATRICES = (517, 1000, 3001, 4099)
FIRST_CALL_SEQUENCE = (513, 1000, 2049, 3001)
FIRST_CALL_QUICK = (5, 9, 14, 23)  # CPU interpret; with their grown sizes, none a bench size
# An op's i-th pass (forward, forward+backward, ...) runs at its sizes times this ** i.
FIRST_CALL_PASS_GROWTH = 1.3


def first_call_sizes(full: bool) -> tuple[int, ...]:
  return FIRST_CALL_TOKENS if full else FIRST_CALL_QUICK


def first_call_cases(build: Callable[[int], list[BenchCase]], sizes) -> list[BenchCase]:
  """First-call cases at ``sizes``: ``build(size)`` gives an op's bench cases at one
  size, every pass; the op's i-th pass runs at ``round(size * FIRST_CALL_PASS_GROWTH
  ** i)``, so no pass finds kernels that another compiled at its size. A trainer's
  first step at a new token count runs forward+backward with no forward compiled
  at that count. At the GPU sizes (hundreds of rows and more), 30% puts each pass's
  size in a bucket of its own: jdet's buckets are at most 25% wide
  (``pallas_kernels._common.bucketed_grid``)."""
  cases = []
  for size in sizes:
    passes = list(dict.fromkeys(case.pass_ for case in build(size)))
    for i, pass_ in enumerate(passes):
      grown = round(size * FIRST_CALL_PASS_GROWTH ** i)
      cases += [case for case in build(grown) if case.pass_ == pass_]
  return cases


@dataclasses.dataclass(frozen=True)
class Op:
  """What the tools need to know about one op (see the module docstring)."""
  name: str
  check_cases: Callable[[bool], list[Case]]
  bench_cases: Callable[[bool], list[BenchCase]]
  sweep_case: Callable[[np.random.Generator], None]
  sharding_case: Callable[[np.random.Generator], tuple]
  first_call_cases: Callable[[bool], list[BenchCase]]


def _row_grad(fn):
  """Gradient of sum(fn(x)**2)/2 w.r.t. x: row i's gradient depends on row i only."""
  return jax.grad(lambda x, *rest: 0.5 * jnp.sum(fn(x, *rest) ** 2))


def _forward_and_backward(fn):
  """``(x..., g) -> (fn(x...), *vjp(g))``: the forward+backward pass benchmarks time."""
  def run(*args):
    out, vjp = jax.vjp(fn, *args[:-1])
    return out, *vjp(args[-1])
  return run


def _first_args(fn, count):
  """``fn`` on the first ``count`` of an input set (a forward pass ignores the cotangent)."""
  return lambda *args: fn(*args[:count])


def _leading_dims(rng, total):
  """Splits ``total`` rows into one or two leading dims (e.g. [batch, seq])."""
  divisors = [d for d in range(1, total + 1) if total % d == 0]
  first = int(rng.choice(divisors))
  return (total,) if rng.integers(2) else (first, total // first)


def _split_check(fn, x, rng, *, what):
  """fn on x's leading dims flattened, whole vs two chunks at a random row."""
  full = fn(x)
  rows = x.reshape((-1,) + x.shape[-2:])
  cut = int(rng.integers(1, rows.shape[0])) if rows.shape[0] > 1 else 1
  parts = [fn(rows[:cut])] + ([fn(rows[cut:])] if cut < rows.shape[0] else [])
  assert_bitwise_equal(jnp.concatenate(parts), full.reshape((-1,) + full.shape[-2:]),
                       what=f"{what}, split at {cut}")
  return full


# ---------------------------------------------------------------------------
# matmul

MATMUL_BENCH_M = (1, 16, 64, 256, 512, 1024, 4096, 16384)
MATMUL_BENCH_KN = ((4096, 4096), (4096, 12288), (4096, 14336), (14336, 4096), (4096, 32000))
MATMUL_QUICK = ((1, (64, 128)), (40, (64, 128)))  # CPU interpret: shapes that finish
# The shape-general grid (`benchmarks/bench_matmul.py --grid`): real models' weights
# (K, N), bf16, and token counts between and beyond the tile sizes.
MATMUL_MODEL_WEIGHTS = {
    "llama3-8b qkv": (4096, 6144), "llama3-8b o": (4096, 4096),
    "llama3-8b gate_up": (4096, 28672), "llama3-8b down": (14336, 4096),
    "llama3-8b lm_head": (4096, 128256),
    "llama3-70b qkv": (8192, 10240), "llama3-70b o": (8192, 8192),
    "llama3-70b gate_up": (8192, 57344), "llama3-70b down": (28672, 8192),
    "llama3-70b lm_head": (8192, 128256),
    "qwen2.5-7b qkv": (3584, 4608), "qwen2.5-7b o": (3584, 3584),
    "qwen2.5-7b gate_up": (3584, 37888), "qwen2.5-7b down": (18944, 3584),
    "qwen2.5-7b lm_head": (3584, 152064),
    "qwen3-30b-a3b expert gate_up": (2048, 1536), "qwen3-30b-a3b expert down": (768, 2048),
    "mid 5120x13824": (5120, 13824), "mid 13824x5120": (13824, 5120),
    "unaligned 3000x1000": (3000, 1000), "unaligned 1000x3000": (1000, 3000),
    "unaligned 4100x2050": (4100, 2050),
}
MATMUL_GRID_M = (1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128, 200, 256, 300, 384, 448, 512, 640,
                 777, 1000, 1024, 1536, 2000, 2048, 3000, 4096, 6000, 8192, 16384)


def _matmul_check(full):
  """A square-ish weight's forward and dA, then a narrow weight's forward and a
  short one's dA, both of which sum fixed chunks of the contraction
  (``matmul_plan.fixed_contraction_chunk``)."""
  m = 1024 if full else 40
  sizes = (1, 17, 129) if full else CPU_CHECK_SIZES
  square, narrow = ((4096, 4096), (4096, 512)) if full else ((96, 80), (1100, 24))
  weights = {"square": square, "narrow": narrow, "short": narrow[::-1]}
  operands = {name: (random_normal(2 * i, (m, k), jnp.bfloat16),
                     random_normal(2 * i + 1, (k, n), jnp.bfloat16))
              for i, (name, (k, n)) in enumerate(weights.items())}

  def case(what, fn, name, reference):
    a, b = operands[name]
    a64, b64 = np.asarray(a[:REFERENCE_ROWS], np.float64), np.asarray(b, np.float64)
    (k, n), chunked = weights[name], ", fixed K-chunks" if name != "square" else ""
    # Against float64 on the host; bf16 outputs (and dA's bf16 cotangent, the
    # forward's output) bound the errors near 4e-3.
    return Case("matmul", f"{what} [{m},{k}]x[{k},{n}]{chunked}", fn, (a, b), (0, None),
                lambda out: relative_error(out[:REFERENCE_ROWS], reference(a64, b64)), 1e-2,
                sizes)

  forward, d_a = lambda a, b: a @ b, lambda a, b: (a @ b) @ b.T
  return [case("fwd bf16", jdet.matmul, "square", forward),
          case("dA (grad of sum of squares)", _row_grad(jdet.matmul), "square", d_a),
          case("fwd bf16", jdet.matmul, "narrow", forward),
          case("dA (grad of sum of squares)", _row_grad(jdet.matmul), "short", d_a)]


def matmul_bench_cases(shapes, *, backends=("pallas",), dtype=jnp.bfloat16,
                       passes=("fwd", "fwd+bwd")):
  """Forward and/or forward+backward cases for (M, (K, N)) shapes, one per jdet backend."""
  cases = []
  for m, (k, n) in shapes:
    def make_args(seed, m=m, k=k, n=n):
      return (random_normal(3 * seed, (m, k), dtype), random_normal(3 * seed + 1, (k, n), dtype),
              random_normal(3 * seed + 2, (m, n), dtype))
    itemsize = jnp.dtype(dtype).itemsize
    set_bytes = (m * k + k * n + 2 * m * n) * itemsize
    for backend in backends:
      op = "matmul" if backend == "pallas" else f"matmul[{backend}]"
      ours = functools.partial(jdet.matmul, backend=backend)
      for pass_, wrap, gemms in (("fwd", lambda f: _first_args(f, 2), 1),
                                 ("fwd+bwd", _forward_and_backward, 3)):
        if pass_ not in passes:
          continue
        cases.append(BenchCase(
            op, f"M={m} K={k} N={n}", pass_, wrap(ours), "jnp.dot (XLA)", wrap(jnp.dot),
            make_args, set_bytes, flops=2.0 * m * k * n * gemms))
  return cases


def _matmul_bench(full):
  return matmul_bench_cases(itertools.product(MATMUL_BENCH_M, MATMUL_BENCH_KN) if full
                            else MATMUL_QUICK)


def _matmul_first_call(full):
  weight = (4096, 4096) if full else (64, 128)
  return first_call_cases(lambda m: matmul_bench_cases([(m, weight)]), first_call_sizes(full))


def _matmul_sweep(rng):
  total, k, n = int(rng.integers(1, 70)), int(rng.integers(1, 150)), int(rng.integers(1, 100))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  a = random_normal(rng, _leading_dims(rng, total) + (k,), dtype)
  b = random_normal(rng, (k, n), dtype)
  what = f"matmul {jnp.dtype(dtype).name} a{a.shape} b{b.shape}"
  if a.ndim == 2:
    a = a[None]
  out = _split_check(lambda x: jdet.matmul(x, b), a, rng, what=what)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  tol = {jnp.float32: 2e-3 if jax.default_backend() == "gpu" else 1e-5,
         jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
  assert np.abs(np.asarray(out, np.float64) - ref).max() <= tol * max(np.abs(ref).max(), 1), what


def _matmul_sharding(rng):
  return jdet.matmul, random_normal(rng, (24, 48)), random_normal(rng, (48, 40))


# ---------------------------------------------------------------------------
# sinkhorn

SINKHORN_ITERS = 20
SINKHORN_BENCH = tuple(itertools.product((4096, 16384, 65536, 262144), (4, 8)))
SINKHORN_QUICK = ((256, 4),)


def _sinkhorn_check(full):
  cases = []
  for n in (4, 8):
    tokens = (65536 if n == 4 else 16384) if full else 32
    logits = random_normal(10 + n, (tokens, n, n)) * 2
    # Each token count compiles its own kernels (~1-2 s for an unrolled backward).
    sizes = (1, 1000) if full else CPU_CHECK_SIZES
    # References run jitted, when the case's error is measured.
    cases.append(Case("sinkhorn", f"fwd n={n} [{tokens},{n},{n}]", jdet.sinkhorn, (logits,),
                      (0,), lambda out, x=logits: relative_error(
                          out, jax.jit(jdet.sinkhorn_reference)(x)), 1e-5, sizes))
    unrolled = lambda x: jdet.sinkhorn(x, grad="unrolled")
    cases.append(Case(
        "sinkhorn", f"grad=unrolled n={n}", _row_grad(unrolled), (logits,), (0,),
        lambda out, x=logits: relative_error(out, jax.jit(_row_grad(jdet.sinkhorn_reference))(x)),
        1e-4, sizes))
    # The implicit gradient is the fixed point's: compare where the iteration has
    # converged (moderate logits, 200 iterations), against the unrolled reference.
    converged = logits * 0.25
    implicit = lambda x: jdet.sinkhorn(x, iters=200, grad="implicit")
    want = jax.jit(_row_grad(lambda x: jdet.sinkhorn_reference(x, iters=200)))
    cases.append(Case(
        "sinkhorn", f"grad=implicit n={n} (200 iters)", _row_grad(implicit), (converged,),
        (0,), lambda out, x=converged, w=want: relative_error(out, w(x)), 1e-3, sizes))
  return cases


def sinkhorn_bench_cases(shapes):
  """Forward and forward+backward (both gradients) cases for (tokens, n) shapes."""
  cases = []
  for tokens, n in shapes:
    matrix_bytes = tokens * n * n * 4

    def make_args(seed, shape=(tokens, n, n)):
      return random_normal(2 * seed, shape), random_normal(2 * seed + 1, shape)

    reference = functools.partial(jdet.sinkhorn_reference, iters=SINKHORN_ITERS)
    label = f"T={tokens} n={n} iters={SINKHORN_ITERS}"
    for grad in ("unrolled", "implicit"):
      ours = functools.partial(jdet.sinkhorn, iters=SINKHORN_ITERS, grad=grad)
      if grad == "unrolled":
        cases.append(BenchCase("sinkhorn", label, "fwd", _first_args(ours, 1),
                               "jit(jnp reference)", _first_args(reference, 1), make_args,
                               2 * matrix_bytes, bytes_moved=2 * matrix_bytes))
      # The implicit backward also reads the saved result.
      cases.append(BenchCase("sinkhorn", label, f"fwd+bwd {grad}", _forward_and_backward(ours),
                             "jit(grad(jnp reference))", _forward_and_backward(reference),
                             make_args, 2 * matrix_bytes,
                             bytes_moved=(5 if grad == "unrolled" else 6) * matrix_bytes))
  return cases


def _sinkhorn_bench(full):
  return sinkhorn_bench_cases(SINKHORN_BENCH if full else SINKHORN_QUICK)


def _sinkhorn_first_call(full):
  return first_call_cases(lambda tokens: sinkhorn_bench_cases([(tokens, 4)]),
                          first_call_sizes(full))


def _sinkhorn_sweep(rng):
  n = int(rng.choice([1, 2, 3, 4, 8, 16]))
  total = int(rng.integers(1, 50))
  iters = int(rng.integers(1, 8))
  init = str(rng.choice(["softmax", "exp"]))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  logits = (3 * random_normal(rng, _leading_dims(rng, total) + (n, n))).astype(dtype)
  fn = functools.partial(jdet.sinkhorn, iters=iters, init=init)
  what = f"sinkhorn n={n} iters={iters} init={init} {jnp.dtype(dtype).name} {logits.shape}"
  out = _split_check(fn, logits.reshape((-1, n, n)), rng, what=what)
  ref = jdet.sinkhorn_reference(logits.astype(jnp.float32), iters=iters, init=init)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref).reshape(out.shape),
                             rtol=1e-5, atol=1e-6, err_msg=what)


def _sinkhorn_sharding(rng):
  return functools.partial(jdet.sinkhorn, iters=5), random_normal(rng, (16, 4, 4))


# ---------------------------------------------------------------------------
# tri_inverse

TRI_INVERSE_BENCH = ((8192, 64), (65536, 64), (8192, 128), (65536, 128))
TRI_INVERSE_QUICK = ((8, 16), (4, 64))


def _linalg_inv(a):
  """The dense baseline: ``jnp.linalg.inv(I - tril(a, -1))`` (LU, pivoting)."""
  identity = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
  return jnp.linalg.inv(identity - jnp.tril(a, -1))


def _tri_inverse_float64(a):
  return np.linalg.inv(np.eye(a.shape[-1]) - np.tril(np.asarray(a, np.float64), -1))


def _tri_inverse_check(full):
  cases = []
  for n in (64, 128) if full else (64,):
    count = 4096 if full else 8
    a = gdn_chunk_matrices(jax.random.key(n), count, n)
    sizes = (1, 64) if full else CPU_CHECK_SIZES
    exact = _tri_inverse_float64(a[:REFERENCE_ROWS])
    cases.append(Case("tri_inverse", f"fwd blocked n={n} [{count},{n},{n}]", jdet.tri_inverse,
                      (a,), (0,), lambda out, exact=exact: relative_error(
                          out[:REFERENCE_ROWS], exact), 1e-5, sizes))
    # The gradient of sum(X**2)/2 is dA = tril(Xᵀ X Xᵀ, -1).
    exact_grad = np.tril(np.swapaxes(exact, -1, -2) @ exact @ np.swapaxes(exact, -1, -2), -1)
    cases.append(Case("tri_inverse", f"dA n={n}", _row_grad(jdet.tri_inverse), (a,), (0,),
                      lambda out, want=exact_grad: relative_error(
                          out[:REFERENCE_ROWS], want), 1e-4, sizes))
  return cases


def tri_inverse_bench_cases(shapes, *, baselines=("solve_triangular", "jnp.linalg.inv")):
  """Forward and forward+backward cases for (count, n) shapes against each baseline."""
  baseline_fns = {"solve_triangular": jdet.tri_inverse_reference, "jnp.linalg.inv": _linalg_inv}
  cases = []
  for count, n in shapes:
    def make_args(seed, count=count, n=n):
      return (gdn_chunk_matrices(jax.random.key(seed), count, n),
              random_normal(seed, (count, n, n)))
    set_bytes = 4 * count * n * n * 4  # a, g, X, dA in f32
    for baseline in baselines:
      baseline_fn = baseline_fns[baseline]
      for pass_, wrap in (("fwd", lambda f: _first_args(f, 1)),
                          ("fwd+bwd", _forward_and_backward)):
        cases.append(BenchCase("tri_inverse", f"{count} x {n}x{n}", pass_,
                               wrap(jdet.tri_inverse), baseline, wrap(baseline_fn), make_args,
                               set_bytes))
  return cases


def _tri_inverse_bench(full):
  return tri_inverse_bench_cases(TRI_INVERSE_BENCH if full else TRI_INVERSE_QUICK)


def _tri_inverse_first_call(full):
  counts = FIRST_CALL_MATRICES if full else first_call_sizes(full)
  return first_call_cases(
      lambda count: tri_inverse_bench_cases([(count, 64)], baselines=("solve_triangular",)),
      counts)


def _tri_inverse_sweep(rng):
  n = int(rng.choice([16, 32]))
  total = int(rng.integers(1, 12))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  a = gdn_chunk_matrices(jax.random.key(int(rng.integers(1 << 30))), total, n).astype(dtype)
  what = f"tri_inverse n={n} {jnp.dtype(dtype).name} [{total},{n},{n}]"
  out = _split_check(jdet.tri_inverse, a, rng, what=what)
  exact = np.linalg.inv(np.eye(n) - np.tril(np.asarray(a, np.float64), -1))
  assert np.abs(np.asarray(out, np.float64) - exact).max() <= 1e-5 * np.abs(exact).max(), what


def _tri_inverse_sharding(rng):
  return jdet.tri_inverse, gdn_chunk_matrices(jax.random.key(int(rng.integers(1 << 30))), 8, 16)



# ---------------------------------------------------------------------------
# dot_product_attention

ATTENTION_HEADS = (32, 8, 128)  # N, K, H of the benchmarks (bf16)
# (kind, B, T, S): causal prefill (T = S) and decode (T = 1 against a full cache).
ATTENTION_BENCH = (("prefill", 1, 4096, 4096), ("prefill", 4, 4096, 4096),
                   *(("decode", b, 1, s) for s in (4096, 32768) for b in (1, 8, 64)))
ATTENTION_QUICK = (("prefill", 1, 32, 32), ("decode", 2, 1, 64))


def _causal_attention(q, k, v):
  return jdet.dot_product_attention(q, k, v, is_causal=True)


def _prefill_decode_chunked(q, k, v):
  """Causal self-attention of q [B, T, N, H] over k, v [B, T, K, H] three ways,
  stacked on axis 1: the whole prefill; decode, each query alone against the cache
  of its sequence's keys so far (a ``lax.scan`` over positions); and a chunked
  prefill (a third of the queries, then the rest against the cache). The
  contract makes the three bitwise equal."""
  b, t = q.shape[:2]

  def attend(queries, lengths, offsets):
    return jdet.dot_product_attention(queries, k, v, is_causal=True,
                                      key_value_seq_lengths=lengths, query_offsets=offsets)

  def decode_one(_, position):
    lengths = jnp.full((b,), position + 1, jnp.int32)
    query = lax.dynamic_slice_in_dim(q, position, 1, axis=1)
    return None, attend(query, lengths, lengths - 1)[:, 0]

  decode = jnp.moveaxis(lax.scan(decode_one, None, jnp.arange(t))[1], 0, 1)
  first = max(1, t // 3)
  chunks = [attend(q[:, :first], jnp.full((b,), first, jnp.int32), jnp.zeros((b,), jnp.int32)),
            attend(q[:, first:], jnp.full((b,), t, jnp.int32), jnp.full((b,), first, jnp.int32))]
  return jnp.stack([_causal_attention(q, k, v), decode, jnp.concatenate(chunks, axis=1)],
                   axis=1)


def _differing_share(paths) -> float:
  """The share of elements of paths [B, 3, ...] (:func:`_prefill_decode_chunked`)
  whose decode or chunked-prefill bits differ from the whole prefill's."""
  paths = bits(paths)
  return float(np.mean(paths[:, 1:] != paths[:, :1]))


def _causal_attention_float64(q, k, v):
  """One sequence's causal attention (q [T, N, H], k/v [T, K, H]) in float64 on the
  host, and its dq for the loss sum(out**2): returns (out, dq), both [T, N, H]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, n, h = q.shape
  heads = k.shape[1]
  scale = 1.0 / np.sqrt(h)
  qg = q.reshape(t, heads, n // heads, h).transpose(1, 2, 0, 3)  # [K, G, T, H]
  kt, vt = k.transpose(1, 0, 2)[:, None], v.transpose(1, 0, 2)[:, None]  # [K, 1, T, H]
  logits = qg @ np.swapaxes(kt, -1, -2) * scale
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = p @ vt
  dout = 2 * out
  dp = dout @ np.swapaxes(vt, -1, -2)
  dlogits = p * (dp - (dout * out).sum(-1, keepdims=True))
  dq = dlogits @ kt * scale
  unstack = lambda x: x.transpose(2, 0, 1, 3).reshape(t, n, h)
  return unstack(out), unstack(dq)


def _attention_check(full):
  b, t, n, kv, h = (8, 1024, 32, 8, 128) if full else (4, 20, 4, 2, 16)
  q = random_normal(20, (b, t, n, h), jnp.bfloat16)
  k, v = (random_normal(21 + i, (b, t, kv, h), jnp.bfloat16) for i in range(2))
  dq = lambda q, k, v: jax.grad(
      lambda q: jnp.sum(_causal_attention(q, k, v).astype(jnp.float32) ** 2))(q)
  # The first sequence's first queries (causal: they see only the keys before them)
  # against float64 on the host; bf16 outputs bound the errors.
  rows = slice(0, REFERENCE_ROWS)
  exact = functools.cache(lambda: _causal_attention_float64(q[0, rows], k[0, rows], v[0, rows]))
  sizes = (1, 3) if full else CPU_CHECK_SIZES
  return [Case("dot_product_attention", f"causal fwd bf16 q{q.shape} kv{k.shape}",
               _causal_attention, (q, k, v), (0, 0, 0),
               lambda out: relative_error(out[0, rows], exact()[0]), 2e-2, sizes),
          Case("dot_product_attention", "dq (grad of sum of squares)", dq, (q, k, v),
               (0, 0, 0), lambda out: relative_error(out[0, rows], exact()[1]), 2e-2, sizes),
          Case("dot_product_attention",
               "prefill == decode == chunked prefill (error: share of elements whose bits differ)",
               _prefill_decode_chunked, (q, k, v), (0, 0, 0), _differing_share, 0.0,
               sizes[:1])]


def attention_bench_cases(configs, *, heads=ATTENTION_HEADS, prefill_baseline="jax.nn"):
  """Cases for ("prefill" or "decode", B, T, S) configs with ``heads`` = (N, K, H),
  bf16: prefill forward and forward+backward against jax.nn (cuDNN where it runs)
  or, with ``prefill_baseline="xla"``, jax.nn's XLA (jax.numpy) attention; decode
  forward against XLA."""
  n, kv, h = heads
  dtype = jnp.bfloat16
  itemsize = jnp.dtype(dtype).itemsize
  cases = []
  for kind, b, t, s in configs:
    def make_args(seed, b=b, t=t, s=s):
      return (random_normal(4 * seed, (b, t, n, h), dtype),
              random_normal(4 * seed + 1, (b, s, kv, h), dtype),
              random_normal(4 * seed + 2, (b, s, kv, h), dtype),
              random_normal(4 * seed + 3, (b, t, n, h), dtype))
    set_bytes = (2 * b * t * n + 2 * b * s * kv) * h * itemsize
    label = f"{kind} B={b} T={t} S={s} N={n} K={kv} H={h}"
    if kind == "prefill":
      baseline, theirs = _prefill_baseline(prefill_baseline, make_args)
      flops = 4.0 * b * n * t * s * h / 2  # causal: half the square
      for pass_, wrap, passes in (("fwd", lambda f: _first_args(f, 3), 1.0),
                                  ("fwd+bwd", _forward_and_backward, 3.5)):
        cases.append(BenchCase("dot_product_attention", label, pass_,
                               wrap(_causal_attention), baseline, wrap(theirs),
                               make_args, set_bytes, flops=flops * passes))
    else:
      lengths = jnp.full((b,), s, jnp.int32)
      ours = functools.partial(jdet.dot_product_attention, key_value_seq_lengths=lengths)
      theirs = functools.partial(jax.nn.dot_product_attention, key_value_seq_lengths=lengths,
                                 implementation="xla")
      cases.append(BenchCase("dot_product_attention", label, "fwd", _first_args(ours, 3),
                             "jax.nn (xla)", _first_args(theirs, 3), make_args, set_bytes,
                             bytes_moved=2.0 * b * s * kv * h * itemsize))
  return cases


def _attention_bench(full):
  return attention_bench_cases(ATTENTION_BENCH if full else ATTENTION_QUICK)


def _attention_first_call(full):
  """Against jax.nn's jax.numpy attention (XLA), as every op against its jnp
  twin (issue 24); cuDNN's first calls are in benchmarks/results/h100.md."""
  lengths = FIRST_CALL_SEQUENCE if full else first_call_sizes(full)
  return first_call_cases(
      lambda t: attention_bench_cases([("prefill", 1, t, t)], prefill_baseline="xla"), lengths)


def _prefill_baseline(which: str, make_args):
  """(label, causal attention) of a prefill's baseline, jax.nn's: ``"jax.nn"``, cuDNN
  where it compiles forward+backward on ``make_args(0)``, else XLA; ``"xla"``, XLA
  (its bf16 jax.numpy attention, not jdet's float32 reference, whose HIGHEST
  precision einsums take XLA many seconds to autotune)."""
  if which not in ("jax.nn", "xla"):
    raise ValueError(f"prefill_baseline must be 'jax.nn' or 'xla', got {which!r}")
  impl = "xla" if which == "xla" else _cudnn_or_xla(make_args(0))
  return f"jax.nn ({impl})", functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                               implementation=impl)


def _cudnn_or_xla(args) -> str:
  """"cudnn" where jax.nn's cuDNN attention compiles forward+backward, else "xla"."""
  try:
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    jax.jit(_forward_and_backward(fn)).lower(*args).compile()
    return "cudnn"
  except Exception:  # noqa: BLE001 - no GPU, no cuDNN, or an unsupported shape
    return "xla"


def _attention_sweep(rng):
  b, s = int(rng.integers(1, 4)), int(rng.integers(1, 40))
  kv = int(rng.choice([1, 2]))
  n, h = kv * int(rng.choice([1, 2])), int(rng.choice([16, 32]))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  q = random_normal(rng, (b, s, n, h), dtype)
  k, v = (random_normal(rng, (b, s, kv, h), dtype) for _ in range(2))
  lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
  what = f"dot_product_attention {jnp.dtype(dtype).name} q{q.shape} kv{k.shape} {lengths}"
  fn = functools.partial(jdet.dot_product_attention, is_causal=True,
                         key_value_seq_lengths=lengths)
  full = fn(q, k, v)
  cut = int(rng.integers(1, s + 1))  # chunked prefill: queries [0, cut) then [cut, s)
  first = jdet.dot_product_attention(q[:, :cut], k, v, is_causal=True,
                                     key_value_seq_lengths=jnp.minimum(lengths, cut))
  valid = np.arange(s)[None, :] < np.asarray(lengths)[:, None]
  assert_bitwise_equal(np.where(valid[:, :cut, None, None], first, 0),
                       np.where(valid[:, :cut, None, None], full[:, :cut], 0),
                       what=f"{what}, chunk [0, {cut})")
  ref = jdet.dot_product_attention_reference(q, k, v, is_causal=True,
                                             key_value_seq_lengths=lengths)
  tol = 1e-5 if dtype == jnp.float32 and jax.default_backend() != "gpu" else 2e-2
  np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(ref, np.float32),
                             rtol=tol, atol=tol, err_msg=what)


def _attention_sharding(rng):
  """One [B, T, N + 2K, H] input holding q, k and v (each sequence its own keys)."""
  def fn(x):
    return _causal_attention(x[:, :, :4], x[:, :, 4:6], x[:, :, 6:])
  return fn, random_normal(rng, (8, 12, 8, 16))

# ---------------------------------------------------------------------------
# rms_norm

# (rows, H): decode, prefill and training token counts at common hidden sizes,
# and a small H that puts many rows in a program.
RMS_NORM_BENCH = ((1, 4096), (256, 4096), (4096, 4096), (8192, 4096), (8192, 8192),
                  (16384, 8192), (8192, 16384), (65536, 128))
RMS_NORM_QUICK = ((8, 96), (40, 200))  # CPU interpret: shapes that finish


def _rms_norm_float64(h, w, eps=1e-6):
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  return h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps) * w


def _rms_norm_check(full):
  m, h = (4096, 8192) if full else (40, 200)
  x, r = random_normal(20, (m, h), jnp.bfloat16), random_normal(21, (m, h), jnp.bfloat16)
  w = random_normal(22, (h,)) + 1.0
  # Each row count compiles its own interpret-mode program on a CPU: keep few there.
  sizes = (1, 17, 1000) if full else CPU_CHECK_SIZES
  fused = lambda x, r, w: jdet.rms_norm(x, w, residual=r)
  x32, r32 = x.astype(jnp.float32), r.astype(jnp.float32)
  plain_grad = lambda x, w: _row_grad(lambda x: jdet.rms_norm(x, w))(x)
  fused_grads = jax.grad(lambda x, r, w: 0.5 * sum(
      jnp.sum(out.astype(jnp.float32) ** 2) for out in jdet.rms_norm(x, w, residual=r)),
                         argnums=(0, 1))
  reference_grads = jax.grad(lambda x, r, w: 0.5 * sum(
      jnp.sum(out ** 2) for out in jdet.rms_norm_reference(x, w, residual=r)), argnums=(0, 1))
  return [
      Case("rms_norm", f"fwd bf16 [{m},{h}]", jdet.rms_norm, (x, w), (0, None),
           lambda out: relative_error(out, _rms_norm_float64(x, w)), 8e-3, sizes),
      Case("rms_norm", "fwd fused residual (y, x + residual)", fused, (x, r, w), (0, 0, None),
           lambda out: relative_error(out[0], _rms_norm_float64(out[1], w)), 8e-3, sizes),
      Case("rms_norm", "dx (grad of sum of squares)", plain_grad, (x32, w), (0, None),
           lambda out: relative_error(out, jax.jit(_row_grad(
               lambda x: jdet.rms_norm_reference(x, w)))(x32)), 1e-5, sizes),
      Case("rms_norm", "dx, dresidual of the fused form", fused_grads, (x32, r32, w),
           (0, 0, None), lambda out: max(relative_error(a, b) for a, b in zip(
               out, jax.jit(reference_grads)(x32, r32, w))), 1e-5, sizes),
  ]


def rms_norm_bench_cases(shapes, *, dtype=jnp.bfloat16):
  """Forward and forward+backward cases for (rows, H) shapes, plain and with the fused
  residual, against the jitted jnp reference. The HBM floor counts one read of
  each input and one write of each output (forward), plus one read of the
  normalised input and of each cotangent and one write of dx (backward)."""
  cases = []
  itemsize = jnp.dtype(dtype).itemsize
  for m, h in shapes:
    row_bytes = m * h * itemsize
    for residual in (False, True):
      arrays = 2 if residual else 1  # inputs (x, residual) = outputs (y, sum) = cotangents

      def make_args(seed, m=m, h=h, residual=residual):
        x, r, g, g_sum = (random_normal(5 * seed + i, (m, h), dtype) for i in range(4))
        w = random_normal(5 * seed + 4, (h,)) + 1.0
        return (x, r, w, (g, g_sum)) if residual else (x, w, g)

      def forward(norm, residual=residual):
        if residual:
          return lambda x, r, w: norm(x, w, residual=r)
        return norm

      forward_bytes = 2 * arrays * row_bytes + h * 4
      backward_bytes = (2 + arrays) * row_bytes + 2 * h * 4
      op = "rms_norm[residual]" if residual else "rms_norm"
      for pass_, wrap, moved in (
          ("fwd", lambda f, n=arrays + 1: _first_args(f, n), forward_bytes),
          ("fwd+bwd", _forward_and_backward, forward_bytes + backward_bytes)):
        cases.append(BenchCase(
            op, f"M={m} H={h}", pass_, wrap(forward(jdet.rms_norm)), "jit(jnp reference)",
            wrap(forward(jdet.rms_norm_reference)), make_args, (2 + 2 * arrays) * row_bytes,
            bytes_moved=moved))
  return cases


def _rms_norm_bench(full):
  return rms_norm_bench_cases(RMS_NORM_BENCH if full else RMS_NORM_QUICK)


def _rms_norm_first_call(full):
  return first_call_cases(lambda m: rms_norm_bench_cases([(m, 4096 if full else 96)]),
                          first_call_sizes(full))


def _rms_norm_sweep(rng):
  total, h = int(rng.integers(1, 50)), int(rng.integers(1, 300))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  x = random_normal(rng, _leading_dims(rng, total) + (h,), dtype)
  w = random_normal(rng, (h,), DTYPES[rng.integers(len(DTYPES))])
  residual = random_normal(rng, x.shape, dtype) if rng.integers(2) else None
  what = (f"rms_norm {jnp.dtype(dtype).name} x{x.shape} weight {jnp.dtype(w.dtype).name} "
          f"residual={residual is not None}")
  fn = lambda x, r: jdet.rms_norm(x, w, residual=r)
  rows = lambda a: None if a is None else a.reshape(-1, h)
  full = jax.tree.map(rows, fn(x, residual))
  cut = int(rng.integers(1, total)) if total > 1 else 1
  pieces = [fn(x.reshape(-1, h)[part], None if residual is None else rows(residual)[part])
            for part in (slice(0, cut), slice(cut, None)) if part.start != total]
  assert_bitwise_equal(jax.tree.map(lambda *p: jnp.concatenate(p), *pieces), full,
                       what=f"{what}, split at {cut}")
  y, total_sum = full if residual is not None else (full, rows(x))
  tol = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
  assert relative_error(y, _rms_norm_float64(total_sum, w)) <= tol, what


def _rms_norm_sharding(rng):
  return jdet.rms_norm, random_normal(rng, (16, 40)), random_normal(rng, (40,))


# ---------------------------------------------------------------------------
# softmax, log_softmax, logsumexp

SOFTMAX_OPS = {"softmax": (jdet.softmax, jax.nn.softmax, jdet.softmax_reference),
               "log_softmax": (jdet.log_softmax, jax.nn.log_softmax,
                               jdet.log_softmax_reference),
               "logsumexp": (jdet.logsumexp, functools.partial(jax.nn.logsumexp, axis=-1),
                             jdet.logsumexp_reference)}
# (rows, row length, dtype): the square 8192 x 8192 target, vocab-long rows (bf16
# input, and the float32 logits token_logprobs's unfused twin normalises), short rows.
SOFTMAX_BENCH = ((8192, 8192, jnp.float32), (8192, 8192, jnp.bfloat16),
                 (2048, 151936, jnp.bfloat16), (2048, 151936, jnp.float32),
                 (65536, 128, jnp.float32))
SOFTMAX_QUICK = ((16, 300, jnp.float32),)  # CPU interpret: 3 sub-chunks a row


def _softmax_float64(name, x):
  x = np.asarray(x, np.float64)
  top = x.max(-1, keepdims=True)
  lse = top + np.log(np.exp(x - top).sum(-1, keepdims=True))
  return {"softmax": np.exp(x - lse), "log_softmax": x - lse, "logsumexp": lse[..., 0]}[name]


def _softmax_check(full):
  # A production vocabulary; rows enough for the batch sizes (the float64 reference
  # on the host is the check's cost).
  m, n = (512, 151936) if full else (24, 300)
  x = random_normal(30, (m, n)) * 3
  sizes = (1, 17, 100) if full else CPU_CHECK_SIZES
  cases = []
  for name, (fn, _, reference) in SOFTMAX_OPS.items():
    cases.append(Case(name, f"fwd f32 [{m},{n}]", fn, (x,), (0,),
                      lambda out, name=name: relative_error(out, _softmax_float64(name, x)),
                      2e-6, sizes))
    # On a CPU each case compiles interpret programs for every batch size: there,
    # only log_softmax's gradient (tests/test_softmax.py covers the others).
    if full or name == "log_softmax":
      cases.append(Case(name, "dx (grad of sum of squares)", _row_grad(fn), (x,), (0,),
                        lambda out, reference=reference: relative_error(
                            out, jax.jit(_row_grad(reference))(x)), 1e-5, sizes))
  return cases


def softmax_bench_cases(shapes, *, names=("softmax", "log_softmax")):
  """Forward and forward+backward against jax.nn for (rows, length, dtype) shapes. The
  HBM floor: read x, write y (forward); plus read x and dy, write dx (backward);
  logsumexp's y and dy are one value a row."""
  cases = []
  for m, n, dtype in shapes:
    array_bytes = m * n * jnp.dtype(dtype).itemsize
    for name in names:
      reduces = name == "logsumexp"

      def make_args(seed, m=m, n=n, dtype=dtype, reduces=reduces):
        return (random_normal(2 * seed, (m, n), dtype),
                random_normal(2 * seed + 1, (m,) if reduces else (m, n), dtype))

      ours, xla, _ = SOFTMAX_OPS[name]
      moved = ((1, 3) if reduces else (2, 5))
      for pass_, wrap, arrays in (("fwd", lambda f: _first_args(f, 1), moved[0]),
                                  ("fwd+bwd", _forward_and_backward, moved[1])):
        cases.append(BenchCase(name, f"{m} x {n} {jnp.dtype(dtype).name}", pass_, wrap(ours),
                               f"jax.nn.{name}", wrap(xla), make_args, 2 * array_bytes,
                               bytes_moved=arrays * array_bytes))
  return cases


def _softmax_bench(full):
  return softmax_bench_cases(SOFTMAX_BENCH if full else SOFTMAX_QUICK)


def _softmax_first_call(full):
  return first_call_cases(
      lambda m: softmax_bench_cases([(m, 32000 if full else 300, jnp.bfloat16)]),
      first_call_sizes(full))


def _softmax_sweep(rng):
  total, n = int(rng.integers(1, 40)), int(rng.integers(1, 600))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  name = list(SOFTMAX_OPS)[rng.integers(len(SOFTMAX_OPS))]
  fn = SOFTMAX_OPS[name][0]
  x = random_normal(rng, _leading_dims(rng, total) + (n,), dtype) * 3
  what = f"{name} {jnp.dtype(dtype).name} x{x.shape}"
  rows = x.reshape(-1, n)
  full = fn(rows)
  cut = int(rng.integers(1, total)) if total > 1 else 1
  parts = [fn(rows[:cut])] + ([fn(rows[cut:])] if cut < total else [])
  assert_bitwise_equal(jnp.concatenate(parts), full, what=f"{what}, split at {cut}")
  tol = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
  assert relative_error(fn(x).reshape(full.shape), _softmax_float64(name, rows)) <= tol, what


def _softmax_sharding(rng):
  return jdet.log_softmax, random_normal(rng, (16, 300))


# ---------------------------------------------------------------------------
# token_logprobs

TOKEN_LOGPROBS_TEMPERATURE = 0.7
# (T, D, V): the target LM head (a Qwen-sized vocab), a Llama-3 vocab, and decode.
TOKEN_LOGPROBS_BENCH = ((8192, 4096, 151936), (8192, 4096, 128256), (64, 4096, 151936))
TOKEN_LOGPROBS_QUICK = ((16, 64, 300),)


def _token_logprobs(h, w, t):
  return jdet.token_logprobs(h, w, t, temperature=TOKEN_LOGPROBS_TEMPERATURE)


def _token_logprobs_unfused(h, w, t):
  """The unfused jdet composition token_logprobs equals bitwise."""
  logits = jdet.matmul(h, w, preferred_element_type=jnp.float32) / TOKEN_LOGPROBS_TEMPERATURE
  return jnp.take_along_axis(jdet.log_softmax(logits), t[..., None], -1)[..., 0]


def _token_logprobs_xla(h, w, t):
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32) / TOKEN_LOGPROBS_TEMPERATURE
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], -1)[..., 0]


def _token_logprobs_float64(h, w, t):
  """The token log-probs [T] and, for the loss sum(logp**2)/2, dhidden [T, D], in
  float64 on the host."""
  w = np.asarray(w, np.float64)
  x = np.asarray(h, np.float64) @ w / TOKEN_LOGPROBS_TEMPERATURE
  top = x.max(-1, keepdims=True)
  log_p = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
  rows, t = np.arange(len(x)), np.asarray(t)
  logp = log_p[rows, t]
  dx = -np.exp(log_p) * logp[:, None]  # d(logp²/2)/dx = logp · (onehot - softmax)
  dx[rows, t] += logp
  return logp, dx @ w.T / TOKEN_LOGPROBS_TEMPERATURE


def _token_logprobs_inputs(seed, t_rows, d, vocab):
  h = random_normal(3 * seed, (t_rows, d), jnp.bfloat16)
  w = (random_normal(3 * seed + 1, (d, vocab)) * (2 / np.sqrt(d))).astype(jnp.bfloat16)
  t = jnp.asarray(np.random.default_rng(3 * seed + 2).integers(0, vocab, (t_rows,)), jnp.int32)
  return h, w, t


def _token_logprobs_check(full):
  # A production vocabulary; D and rows small enough that drawing the weight and the
  # float64 reference (a [T, D] x [D, V] product on the host) stay cheap.
  t_rows, d, vocab = (256, 1024, 151936) if full else (24, 40, 300)
  h, w, t = _token_logprobs_inputs(0, t_rows, d, vocab)
  sizes = (1, 17, 100) if full else CPU_CHECK_SIZES
  dhidden = lambda h, w, t: _row_grad(_token_logprobs)(h, w, t)
  rows = slice(0, REFERENCE_ROWS)
  exact = functools.cache(lambda: _token_logprobs_float64(h[rows], w, t[rows]))
  return [
      Case("token_logprobs", f"fwd bf16 T={t_rows} D={d} V={vocab}", _token_logprobs,
           (h, w, t), (0, None, 0), lambda out: relative_error(out[rows], exact()[0]), 1e-5,
           sizes),
      Case("token_logprobs", "fused vs unfused jdet (error 0 = bitwise)", _token_logprobs,
           (h, w, t), (0, None, 0),
           lambda out: relative_error(out, jax.jit(_token_logprobs_unfused)(h, w, t)), 0.0,
           sizes),
      # dhidden is bf16 like hidden: its rounding bounds the error near 4e-3.
      Case("token_logprobs", "dhidden (grad of sum of squares)", dhidden, (h, w, t),
           (0, None, 0), lambda out: relative_error(out[rows], exact()[1]), 1e-2, sizes),
  ]


def token_logprobs_bench_cases(shapes):
  """Forward and forward+backward against XLA's dot + log_softmax + gather, bf16."""
  cases = []
  for t_rows, d, vocab in shapes:
    def make_args(seed, t_rows=t_rows, d=d, vocab=vocab):
      h, w, t = _token_logprobs_inputs(seed, t_rows, d, vocab)
      return h, w, t, random_normal(3 * seed + 2, (t_rows,))

    def forward(fn):
      return lambda h, w, t, g: fn(h, w, t)

    def forward_and_backward(fn):
      def run(h, w, t, g):
        out, vjp = jax.vjp(lambda h, w: fn(h, w, t), h, w)
        return out, *vjp(g)
      return run

    for pass_, wrap, passes in (("fwd", forward, 1), ("fwd+bwd", forward_and_backward, 3)):
      cases.append(BenchCase(
          "token_logprobs", f"T={t_rows} D={d} V={vocab} bf16", pass_, wrap(_token_logprobs),
          "XLA dot + log_softmax + gather", wrap(_token_logprobs_xla), make_args,
          (t_rows * d + d * vocab) * 2, flops=2.0 * t_rows * d * vocab * passes))
  return cases


def _token_logprobs_bench(full):
  return token_logprobs_bench_cases(TOKEN_LOGPROBS_BENCH if full else TOKEN_LOGPROBS_QUICK)


def _token_logprobs_first_call(full):
  width, vocab = (4096, 151936) if full else (64, 300)
  return first_call_cases(lambda t: token_logprobs_bench_cases([(t, width, vocab)]),
                          FIRST_CALL_SEQUENCE if full else first_call_sizes(full))


def _token_logprobs_sweep(rng):
  total, d, vocab = int(rng.integers(1, 30)), int(rng.integers(1, 70)), int(rng.integers(1, 400))
  h, w, t = _token_logprobs_inputs(int(rng.integers(1 << 20)), total, d, vocab)
  what = f"token_logprobs T={total} D={d} V={vocab}"
  full = _token_logprobs(h, w, t)
  cut = int(rng.integers(1, total)) if total > 1 else 1
  parts = [_token_logprobs(h[:cut], w, t[:cut])] + (
      [_token_logprobs(h[cut:], w, t[cut:])] if cut < total else [])
  assert_bitwise_equal(jnp.concatenate(parts), full, what=f"{what}, split at {cut}")
  assert_bitwise_equal(full, _token_logprobs_unfused(h, w, t), what=f"{what}: fused vs unfused")
  assert relative_error(full, _token_logprobs_float64(h, w, t)[0]) <= 1e-5, what


def _token_logprobs_sharding(rng):
  """Tokens from each row's own argmax (row-local), so only hidden is batched."""
  w = random_normal(rng, (40, 300)).astype(jnp.bfloat16)
  fn = lambda h, w: _token_logprobs(h, w, jax.lax.stop_gradient(jnp.argmax(h, axis=-1)))
  return fn, random_normal(rng, (16, 40)).astype(jnp.bfloat16), w


# ---------------------------------------------------------------------------

OPS: dict[str, Op] = {op.name: op for op in (
    Op("matmul", _matmul_check, _matmul_bench, _matmul_sweep, _matmul_sharding,
       _matmul_first_call),
    Op("rms_norm", _rms_norm_check, _rms_norm_bench, _rms_norm_sweep, _rms_norm_sharding,
       _rms_norm_first_call),
    Op("sinkhorn", _sinkhorn_check, _sinkhorn_bench, _sinkhorn_sweep, _sinkhorn_sharding,
       _sinkhorn_first_call),
    Op("softmax", _softmax_check, _softmax_bench, _softmax_sweep, _softmax_sharding,
       _softmax_first_call),
    Op("token_logprobs", _token_logprobs_check, _token_logprobs_bench, _token_logprobs_sweep,
       _token_logprobs_sharding, _token_logprobs_first_call),
    Op("tri_inverse", _tri_inverse_check, _tri_inverse_bench, _tri_inverse_sweep,
       _tri_inverse_sharding, _tri_inverse_first_call),
    Op("dot_product_attention", _attention_check, _attention_bench, _attention_sweep,
       _attention_sharding, _attention_first_call),
)}
