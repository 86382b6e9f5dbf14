"""Seeded random invariance fuzz: ``python -m jdet check --trials N --seed S``.

A trial draws one op's case: a shape within the op's supported range (small on
CPU, where every new shape compiles interpret-mode kernels), a dtype and
options, a full batch of random rows (tokens; matrices for sinkhorn and
tri_inverse; whole sequences for attention, whose valid key count each derives
from its own keys); then a second batch that holds some of
those rows (random ones, possibly repeated) among fresh rows at random
positions, in a random leading-dim layout or split into chunks, and a
transform: ``jit``, ``vmap``, ``lax.scan`` or ``lax.fori_loop`` over the
chunks, of the forward or of the per-row gradient (for ``matmul`` also the
weight gradient with zero-cotangent rows appended). The rows' results must be
bitwise those of the full batch under plain ``jit``.

``GENERATORS`` maps each op to ``trial(Trial)``: it returns None or raises an
AssertionError whose message describes the case (op, shapes, dtype, options,
transform, rows). Ops without one run their registry ``sweep_case``.
:func:`run_trial` seeds the trial from (seed, op, index) and adds the one-line
command that replays it. ``--pool P`` draws each trial's case from P cases per
op, its batches from one or two times the case's rows and their layouts from
two per batch, so that compiled programs repeat: what makes 10^4 trials
affordable where every new shape compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jdet
from jdet._registry import OPS, SOFTMAX_OPS
from jdet._workers import worker_pool
from jdet.bench import on_gpu, progress_bar
from jdet.testing import assert_bitwise_equal, release_compiled_programs
from pallas_kernels.tri_inverse import DOUBLING_SIZES

ON_GPU = on_gpu()
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
OUTERS = ("jit", "vmap", "scan", "fori_loop")
# Unpooled trials compile new programs nearly every time; every compiled XLA:CPU
# program keeps code mapped, and a process may map only so many regions
# (vm.max_map_count): 385 unpooled CPU matmul trials ran out ("LLVM compilation
# error: Cannot allocate memory"). So compiled programs are released this often.
RELEASE_EVERY = 50
REPORT_SECONDS = 20  # how often a worker process prints its shard's progress


@dataclasses.dataclass(frozen=True)
class Trial:
  """A trial's random streams: ``case_rng`` draws the case (shapes, dtypes,
  options), ``rng`` the data, the batch composition and the transform. Without
  a pool they are one stream. With one (``pooled``), trial ``index`` takes case
  ``index % pool``, batches of one or two times its rows and, of their layouts,
  the first two leading-dim splits or the fewest and the most chunks, so the
  compiled programs repeat from trial to trial."""
  rng: np.random.Generator
  case_rng: np.random.Generator
  pooled: bool = False


def _pick(rng, options):
  return options[int(rng.integers(len(options)))]


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _device_normal(key, scale, *, shape, dtype):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _normal(rng, shape, dtype, scale=1.0):
  """Standard-normal data, drawn on the device from a key that the trial's stream
  picks: NumPy took seconds per trial for the GPU's [4096, 151936] weights."""
  key = jax.random.key(int(rng.integers(2**31)))
  return _device_normal(key, scale, shape=tuple(int(d) for d in shape), dtype=jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _row_function(op, options: tuple, grad: bool, batched: int):
  """``op(*batched_args, *shared_args, **options)``, or with ``grad`` its VJP with
  respect to the batched args (the cotangent then follows them). Cached, so that
  jit reuses its compilations from trial to trial."""
  fn = lambda *args: op(*args, **dict(options))
  if not grad:
    return fn

  def vjp(*args):
    inputs, cotangent, shared = args[:batched], args[batched], args[batched + 1:]
    out, pullback = jax.vjp(lambda *xs: fn(*xs, *shared), *inputs)
    return pullback(cotangent.astype(out.dtype))
  return vjp


@functools.lru_cache(maxsize=None)
def _transformed(fn, outer: str, shared: int):
  """jit of ``fn`` applied over a leading chunk axis of every batched arg."""
  if outer == "jit":
    return jax.jit(fn)

  def over_chunks(*args):
    batched, rest = args[:len(args) - shared], args[len(args) - shared:]
    if outer == "vmap":
      return jax.vmap(fn, in_axes=(0,) * len(batched) + (None,) * shared)(*args)
    step = lambda xs: fn(*xs, *rest)
    if outer == "scan":
      return lax.scan(lambda c, xs: (c, step(xs)), 0, batched)[1]
    first = jax.eval_shape(step, tuple(x[0] for x in batched))
    out = jax.tree.map(lambda s: jnp.zeros((batched[0].shape[0],) + s.shape, s.dtype), first)
    return lax.fori_loop(0, batched[0].shape[0], lambda i, out: jax.tree.map(
        lambda o, r: o.at[i].set(r), out, step(tuple(x[i] for x in batched))), out)
  return jax.jit(over_chunks)


@jax.jit
def _gather_rows(batched, fresh, source):
  """Each batched arg's mixed batch: rows ``source`` of the arg's rows followed by
  its fresh rows."""
  return tuple(jnp.concatenate([x, f], axis=0)[source] for x, f in zip(batched, fresh))


def _divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def check_rows(trial: Trial, case: str, op, options: tuple, batched: tuple, shared: tuple,
               fresh, *, leading_dims: bool = True) -> None:
  """The invariance check every generator runs.

  ``op(*batched, *shared, **dict(options))`` maps rows (the leading axis of each
  batched arg) to rows; fresh(count) returns ``count`` new rows of each batched
  arg. ``leading_dims``: the op also takes rows spread over several leading dims
  (under ``jit`` the batch is then reshaped at random). Raises AssertionError
  describing the case on any differing bit.
  """
  rng = trial.rng
  rows = batched[0].shape[0]
  grad = bool(rng.integers(2))
  fn = _row_function(op, options, grad, len(batched))
  if grad:
    probe = jax.eval_shape(_row_function(op, options, False, len(batched)), *batched, *shared)
    batched = batched + (_normal(rng, probe.shape, jnp.float32),)
    make_fresh = fresh
    fresh = lambda count: make_fresh(count) + (_normal(rng, (count,) + probe.shape[1:],
                                                               jnp.float32),)
  outer = _pick(rng, OUTERS)
  want = _transformed(fn, "jit", len(shared))(*batched, *shared)

  if trial.pooled:
    total = rows * int(rng.integers(1, 3))
    chosen = int(rng.integers(1, rows + 1))
    extra = total - chosen
  else:
    chosen = int(rng.integers(1, rows + 1))
    extra = int(rng.integers(0, rows + 1))
    total = chosen + extra
  picks = rng.choice(rows, chosen, replace=bool(rng.integers(2)))
  order = rng.permutation(total)
  # Row i of the mixed batch is row source[i] of [batch; fresh rows]. The fresh
  # rows are always ``total``, so that a pool's gathers repeat their shapes.
  source = np.concatenate([picks, rows + np.arange(extra)])[order]
  mixed = _gather_rows(batched, fresh(total), jnp.asarray(source, jnp.int32))
  positions = np.argsort(order)[:chosen]  # where each picked row landed
  feature = lambda x: x.shape[1:]
  if outer == "jit":
    splits = [(d, total // d) for d in _divisors(total)[1:-1]] if leading_dims else []
    lead = _pick(rng, [(total,), *splits][:2 if trial.pooled else None])
    layout = f"leading dims {lead}"
  else:
    chunk_counts = _divisors(total)[1:] or [1]
    if trial.pooled:  # the fewest and the most chunks: layouts repeat too
      chunk_counts = sorted({chunk_counts[0], chunk_counts[-1]})
    chunks = _pick(rng, chunk_counts)
    lead = (chunks, total // chunks)
    layout = f"{chunks} chunks of {total // chunks}"
  args = tuple(x.reshape(lead + feature(x)) for x in mixed)
  describe = (f"{case}; transform={outer}/{'grad' if grad else 'forward'}; rows "
              f"{picks.tolist()} of a batch of {rows}, at positions {positions.tolist()} "
              f"of a batch of {total} ({layout})")
  try:
    got = _transformed(fn, outer if len(lead) > 1 else "jit", len(shared))(*args, *shared)
  except Exception as err:  # an op that fails on a valid case is a finding too
    raise AssertionError(f"{describe}: raised {type(err).__name__}: {err}") from err
  # The comparisons index on the host: a device gather would compile for every
  # count of picked rows.
  got = jax.tree.map(lambda y: np.asarray(y).reshape((total,) + y.shape[len(lead):])[positions],
                     got)
  assert_bitwise_equal(got, jax.tree.map(lambda y: np.asarray(y)[picks], want), what=describe)


@functools.lru_cache(maxsize=None)
def _weight_gradient(matmul, precision):
  return jax.jit(jax.grad(lambda b, a, g: jnp.sum(matmul(a, b, precision=precision)
                                                  .astype(jnp.float32) * g)))


def matmul_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  k = _pick(case_rng, (1, 16, 64, 65, 130) if not ON_GPU else (1, 64, 100, 512, 4096))
  n = _pick(case_rng, (1, 8, 33, 64) if not ON_GPU else (1, 128, 300, 1024, 4096))
  rows = int(case_rng.integers(1, 25 if not ON_GPU else 300))
  dtype = _pick(case_rng, DTYPES)
  precision = _pick(case_rng, (None, "highest"))
  a, b = _normal(rng, (rows, k), dtype), _normal(rng, (k, n), dtype)
  options = (("precision", precision),)
  case = (f"matmul a [{rows},{k}] b [{k},{n}] {jnp.dtype(dtype).name} "
          f"precision={precision}")
  if rng.integers(4) == 0:  # dB: appending rows with zero cotangent changes no bit
    extra = rows if trial.pooled else int(rng.integers(1, rows + 1))
    g = _normal(rng, (rows, n), jnp.float32)
    db = _weight_gradient(jdet.matmul, precision)
    padded = db(b, jnp.concatenate([a, _normal(rng, (extra, k), dtype)]),
                jnp.concatenate([g, jnp.zeros((extra, n), jnp.float32)]))
    assert_bitwise_equal(padded, db(b, a, g), what=f"{case}; transform=jit/grad dB; "
                         f"{extra} rows with zero cotangent appended")
    return
  check_rows(trial, case, jdet.matmul, options, (a,), (b,),
             lambda count: (_normal(rng, (count, k), dtype),))


def sinkhorn_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  n = _pick(case_rng, (1, 2, 3, 4, 8) if not ON_GPU else tuple(range(1, 17)))
  iters = _pick(case_rng, (1, 3, 20))
  init, grad = _pick(case_rng, ("softmax", "exp")), _pick(case_rng, ("unrolled", "implicit"))
  dtype = _pick(case_rng, DTYPES)
  rows = int(case_rng.integers(1, 13 if not ON_GPU else 3000))
  scale = _pick(case_rng, (0.5, 2.0, 8.0))
  options = (("iters", iters), ("init", init), ("grad", grad))
  case = (f"sinkhorn logits [{rows},{n},{n}]*{scale} {jnp.dtype(dtype).name} iters={iters} "
          f"init={init} grad={grad}")
  make = lambda count: _normal(rng, (count, n, n), dtype, scale)
  check_rows(trial, case, jdet.sinkhorn, options, (make(rows),), (),
             lambda count: (make(count),))


def tri_inverse_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  n = _pick(case_rng, (16, 32) if not ON_GPU else (16, 32, 64, 128))
  method = _pick(case_rng, ("blocked", "doubling") if n in DOUBLING_SIZES else ("blocked",))
  dtype = _pick(case_rng, DTYPES)
  rows = int(case_rng.integers(1, 9 if not ON_GPU else 500))
  options = (("method", method),)
  case = f"tri_inverse a [{rows},{n},{n}] {jnp.dtype(dtype).name} method={method}"

  def make(count):
    seed = int(rng.integers(2**31))
    return jdet.gdn_chunk_matrices(jax.random.key(seed), count, n).astype(dtype)
  check_rows(trial, case, jdet.tri_inverse, options, (make(rows),), (),
             lambda count: (make(count),))


def _rms_norm_rows(x, weight):
  return jdet.rms_norm(x, weight)


def _rms_norm_residual_rows(x, residual, weight):
  """Both outputs of the fused form as one row: [normalised, sum]."""
  return jnp.concatenate(jdet.rms_norm(x, weight, residual=residual), axis=-1)


def rms_norm_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  # GPU: aligned and odd widths over one and several chunks (_common.row_sum's two kinds).
  h = _pick(case_rng, (1, 7, 64, 200) if not ON_GPU else (64, 1000, 4096, 8192, 10001, 16384))
  rows = int(case_rng.integers(1, 25 if not ON_GPU else 300))
  dtype, weight_dtype = _pick(case_rng, DTYPES), _pick(case_rng, DTYPES)
  fused = bool(case_rng.integers(2))
  weight = _normal(rng, (h,), weight_dtype)
  case = (f"rms_norm x [{rows},{h}] {jnp.dtype(dtype).name} weight "
          f"{jnp.dtype(weight_dtype).name} residual={fused}")
  make = lambda count: tuple(_normal(rng, (count, h), dtype) for _ in range(1 + fused))
  op = _rms_norm_residual_rows if fused else _rms_norm_rows
  check_rows(trial, case, op, (), make(rows), (weight,), make)


def softmax_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  name = _pick(case_rng, tuple(SOFTMAX_OPS))
  # GPU: aligned and odd lengths over one and several sub-chunks (_common.row_sum's two kinds).
  n = _pick(case_rng, (1, 5, 64, 600) if not ON_GPU else (1000, 8192, 8193, 32000, 50257,
                                                            151936))
  rows = int(case_rng.integers(1, 25 if not ON_GPU else 300))
  dtype = _pick(case_rng, DTYPES)
  scale = _pick(case_rng, (1.0, 8.0))
  case = f"{name} x [{rows},{n}]*{scale} {jnp.dtype(dtype).name}"
  make = lambda count: (_normal(rng, (count, n), dtype, scale),)
  check_rows(trial, case, SOFTMAX_OPS[name][0], (), make(rows), (), make)


def _token_logprobs_rows(hidden, weight, temperature):
  """Each row's token is its own argmax over hidden, modulo the vocabulary (row-local)."""
  tokens = lax.stop_gradient(jnp.argmax(hidden, axis=-1) % weight.shape[1]).astype(jnp.int32)
  return jdet.token_logprobs(hidden, weight, tokens, temperature=temperature)


def token_logprobs_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  d = _pick(case_rng, (1, 16, 70) if not ON_GPU else (64, 1024, 4096))
  vocab = _pick(case_rng, (1, 33, 400) if not ON_GPU else (1000, 32000, 151936))
  rows = int(case_rng.integers(1, 20 if not ON_GPU else 300))
  dtype = _pick(case_rng, DTYPES)
  temperature = _pick(case_rng, (1.0, 0.7))
  weight = _normal(rng, (d, vocab), dtype, d ** -0.5)
  case = (f"token_logprobs hidden [{rows},{d}] weight [{d},{vocab}] {jnp.dtype(dtype).name} "
          f"temperature={temperature}")
  make = lambda count: (_normal(rng, (count, d), dtype),)
  check_rows(trial, case, _token_logprobs_rows, (("temperature", temperature),), make(rows),
             (weight,), make)


def _attention_rows(query, key, value, is_causal):
  """Each sequence's valid key count comes from its own keys (row-local)."""
  lengths = lax.stop_gradient(jnp.sum(key[:, :, 0, 0] > -0.5, axis=1)).astype(jnp.int32)
  return jdet.dot_product_attention(query, key, value, is_causal=is_causal,
                                    key_value_seq_lengths=lengths)


def attention_trial(trial: Trial) -> None:
  case_rng, rng = trial.case_rng, trial.rng
  t = int(case_rng.integers(1, 20 if not ON_GPU else 300))
  s = t if case_rng.integers(2) else int(case_rng.integers(t, 2 * t + 1))
  kv = _pick(case_rng, (1, 2))
  n = kv * _pick(case_rng, (1, 2) if not ON_GPU else (1, 4))
  h = _pick(case_rng, (16, 32) if not ON_GPU else (64, 128))
  rows = int(case_rng.integers(1, 6 if not ON_GPU else 17))
  dtype = _pick(case_rng, DTYPES)
  causal = bool(case_rng.integers(2))
  case = (f"dot_product_attention query [{rows},{t},{n},{h}] key/value [{rows},{s},{kv},{h}] "
          f"{jnp.dtype(dtype).name} is_causal={causal}")
  make = lambda count: (_normal(rng, (count, t, n, h), dtype),
                        *(_normal(rng, (count, s, kv, h), dtype) for _ in range(2)))
  check_rows(trial, case, _attention_rows, (("is_causal", causal),), make(rows), (), make,
             leading_dims=False)  # [B, T, N, H]: one batch dim


GENERATORS = {"matmul": matmul_trial, "sinkhorn": sinkhorn_trial,
              "tri_inverse": tri_inverse_trial, "rms_norm": rms_norm_trial,
              "softmax": softmax_trial, "token_logprobs": token_logprobs_trial,
              "dot_product_attention": attention_trial}


def trial_rng(op: str, seed: int, index: int, stream: int = 0) -> np.random.Generator:
  """The generator of trial ``index`` of ``op`` under ``seed`` (independent of
  which other ops and trials run); ``stream`` 1 is a pool case's."""
  return np.random.default_rng([seed, zlib.crc32(op.encode()), index, stream])


def make_trial(op: str, seed: int, index: int, pool: int | None = None) -> Trial:
  rng = trial_rng(op, seed, index)
  if pool is None:
    return Trial(rng, rng)
  return Trial(rng, trial_rng(op, seed, index % pool, stream=1), pooled=True)


def repro_command(op: str, seed: int, index: int, pool: int | None = None) -> str:
  pool_arg = "" if pool is None else f", pool={pool}"
  return (f"python -c \"import jdet.fuzz as f; f.run_trial('{op}', seed={seed}, "
          f"index={index}{pool_arg})\"")


def generator(op: str):
  """The op's trial: its entry in GENERATORS, else its registry ``sweep_case``
  (which draws everything from the trial's data stream)."""
  if op in GENERATORS:
    return GENERATORS[op]
  return lambda trial: OPS[op].sweep_case(trial.rng)


def run_trial(op: str, *, seed: int, index: int, pool: int | None = None) -> None:
  """Runs one trial; on failure raises AssertionError with the case and the
  command that replays it."""
  try:
    generator(op)(make_trial(op, seed, index, pool))
  except AssertionError as err:
    raise AssertionError(f"{op} trial {index} (seed {seed}) failed: {err}\n"
                         f"REPRO: {repro_command(op, seed, index, pool)}") from None


def shard_indices(trials: int, pool: int | None, shard: int, shards: int) -> list[int]:
  """The trial indices of shard ``shard`` of ``shards``. With a pool, shards take
  whole rounds of it (trials ``r * pool`` to ``(r + 1) * pool - 1`` for rounds
  ``r`` = shard, shard + shards, ...), so every shard meets every case and a
  program one shard compiled serves the others through the shared compilation
  cache; without one, every ``shards``-th trial."""
  return [i for i in range(trials) if (i // (pool or 1)) % shards == shard]


def run_shard(op: str, trials: int, seed: int, pool: int | None, shard: int,
              shards: int) -> list[str]:
  """Runs ``op``'s trials of shard ``shard`` of ``shards`` (:func:`shard_indices`)
  and returns the failures."""
  failures = []
  indices = shard_indices(trials, pool, shard, shards)
  reported = time.perf_counter()
  for count, index in enumerate(indices):
    if shards == 1:
      progress_bar(count, len(indices), op)
    elif time.perf_counter() - reported > REPORT_SECONDS:
      reported = time.perf_counter()  # a worker's progress, for runs cut off by a timeout
      print(f"{op} shard {shard}/{shards}: {count} of {len(indices)} trials done, "
            f"{len(failures)} failed", flush=True)
    try:
      run_trial(op, seed=seed, index=index, pool=pool)
    except AssertionError as err:
      failures.append(str(err))
      print(failures[-1], flush=True)  # now, in case the run never ends
    if pool is None and (count + 1) % RELEASE_EVERY == 0:
      release_compiled_programs()
  release_compiled_programs()  # a pool's programs repeat within an op, not across ops
  if shards == 1:
    progress_bar(len(indices), len(indices), op)
  return failures


def main(ops, trials: int, seed: int, pool: int | None = None, workers: int = 1) -> int:
  """Runs ``trials`` trials per op (drawing their cases from ``pool`` cases per op
  when given), in ``workers`` processes (:mod:`jdet._workers`) when more than one;
  prints each failure and its repro as it happens and a line per op; returns 0 if
  every trial passed, else 1."""
  device = jax.devices()[0]
  pooled = "" if pool is None else f", cases from a pool of {pool} per op"
  spread = f", {workers} worker processes" if workers > 1 else ""
  print(f"jdet fuzz on {device.device_kind} ({device.platform}), jax {jax.__version__}: "
        f"{trials} trials per op, seed {seed}{pooled}{spread}")
  failed = 0
  ops = list(ops or OPS)
  if workers > 1:
    with worker_pool(workers) as processes:
      began = time.perf_counter()
      jobs = {op: [processes.submit(run_shard, op, trials, seed, pool, shard, workers)
                   for shard in range(workers)] for op in ops}
      for op in ops:
        failures = [f for job in jobs[op] for f in job.result()]
        failed += len(failures)
        print(f"{op}: {trials - len(failures)} of {trials} trials passed "
              f"({time.perf_counter() - began:.0f} s since the start)", flush=True)
  else:
    for op in ops:
      start = time.perf_counter()
      failures = run_shard(op, trials, seed, pool, 0, 1)
      failed += len(failures)
      print(f"{op}: {trials - len(failures)} of {trials} trials passed in "
            f"{time.perf_counter() - start:.0f} s", flush=True)
  print(f"{'FAIL' if failed else 'ok'}: {failed} failed trials")
  return 1 if failed else 0
