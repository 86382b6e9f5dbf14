"""Times candidate GEMM tiles per M bucket on the GPU and checks their bits agree.

Writes nothing: its printed tables are the measurement behind the tile tables in
``pallas_kernels/matmul.py`` (Triton ladder) and ``pallas_kernels/hopper_matmul.py``.
Run: ``PYTHONPATH=. python3 benchmarks/tune_matmul.py [--m 1 16 64 256 4096]
[--kn 3000 1000] [--hopper-m 1024 4096] [--row-tiles-m 200 448]``; ``--m`` sweeps the
Triton ladder's candidates for each M (those listed for the largest key <= M) over
the ``--kn`` weights (default: the model weights of HOPPER_KN); ``--hopper-m`` sweeps only
the Hopper kernel's strip configs (forward, dA, dB) at those M;
``--row-tiles-m`` its forward/dA tiles against the plan's pick;
``--at-b`` the Triton dB kernel's tiles;
``--candidates-m`` the forward's every plan a rule could choose (Mosaic tiles
at any row count, the Triton ladder, a chunked contraction's split) over the
``--kn`` weights;
``--split-m`` chunked GEMMs with their chunks inside each program and on programs of
their own (``matmul_plan.plan``'s ``split_chunks``) over narrow weights (``--kn``,
default SPLIT_KN): the measurement behind ``matmul_plan.SPLIT_CHUNK_ROWS``,
``SPLIT_MIN_CHUNKS`` and ``MANY_ROWS_SPLIT_MIN_CHUNKS``.
"""

from __future__ import annotations

import argparse
import functools

import jax.numpy as jnp
import numpy as np

from jdet import bench
from jdet.testing import random_normal
from pallas_kernels import hopper_matmul as hopper
from pallas_kernels import matmul as kernels
from pallas_kernels import matmul_plan
from pallas_kernels.matmul import BLOCK_K, Layout

bf16 = jnp.dtype(jnp.bfloat16)

T = kernels.MatmulTiles
# Forward/dA candidates per M: the ladder's tiles at several stage counts.
DECODE_CANDIDATES = ([T(16, 32, 4, s) for s in (6, 8, 10, 12)]
                     + [T(16, 64, 4, s) for s in (5, 8, 10)] + [T(64, 64, 4, s) for s in (4, 8)])
LADDER_CANDIDATES = {
    1: DECODE_CANDIDATES,
    16: DECODE_CANDIDATES,
    64: [T(16, 64, 4, s) for s in (5, 8)] + [T(64, 64, 4, s) for s in (4, 6, 8, 10)]
        + [T(64, 128, 4, s) for s in (4, 6, 8)],
    256: [T(64, 128, 4, s) for s in (4, 5, 6, 7, 8)] + [T(64, 64, 4, s) for s in (6, 8)]
         + [T(128, 128, 8, s) for s in (3, 4, 5)] + [T(128, 256, 8, 3)],
    1024: [T(128, 256, 8, s) for s in (3, 4)] + [T(128, 128, 8, s) for s in (3, 4, 5)]
          + [T(128, 128, 4, 4), T(64, 256, 4, 4), T(256, 128, 8, 3), T(128, 64, 4, 5)],
}
COPIES = 3  # rotate B so that it does not sit in the 50 MB L2
H = hopper.HopperTiles
HOPPER_CANDIDATES = (H(strip_dim=1, strip_width=1), H(strip_dim=1, strip_width=8),
                     H(strip_dim=0, strip_width=8), H(strip_dim=1, strip_width=16),
                     H(strip_dim=0, strip_width=4))
HOPPER_KN = ((4096, 4096), (4096, 12288), (4096, 14336), (14336, 4096), (4096, 32000))
# Mosaic GPU tiles a candidate sweep times: those of least estimated time.
MOSAIC_CANDIDATES = 6
# Weights whose forward sums fixed chunks (results narrower than 2048 columns): K/V
# projections, MoE-sized and unaligned ones, and 1.1-1.5 chunks (3000 x 1000, 1152 x 512).
SPLIT_KN = ((8192, 1024), (4096, 1024), (3584, 512), (5120, 640), (14336, 1536),
            (7800, 296), (2560, 456), (3000, 1000), (1152, 512))


def _hopper_passes(m, k, n):
  """(pass, XLA fn, Triton fn, Hopper layout, argument sets) for forward, dA, dB."""
  a = [random_normal(3 * i, (m, k), jnp.bfloat16) for i in range(COPIES)]
  b = [random_normal(3 * i + 1, (k, n), jnp.bfloat16) for i in range(COPIES)]
  d = [random_normal(3 * i + 2, (m, n), jnp.bfloat16) for i in range(COPIES)]
  triton = functools.partial(kernels.matmul, out_dtype=jnp.bfloat16, precision=None,
                             interpret=False)
  at_b = functools.partial(kernels.matmul_at_b, out_dtype=jnp.bfloat16, precision=None,
                           tiles=matmul_plan.triton_tiles(Layout.TN, k, n, bf16, bf16),
                           interpret=False)
  fwd_tiles = matmul_plan.triton_tiles(Layout.NN, m, n, bf16, bf16)
  da_tiles = matmul_plan.triton_tiles(Layout.NT, m, k, bf16, bf16)
  return (
      ("fwd", jnp.dot, lambda x, y: triton(x[None], y[None], transpose_b=False,
                                           tiles=fwd_tiles)[0],
       Layout.NN, list(zip(a, b))),
      ("dA", lambda x, y: jnp.dot(x, y.T),
       lambda x, y: triton(x[None], y[None], transpose_b=True, tiles=da_tiles)[0],
       Layout.NT, list(zip(d, b))),
      ("dB", lambda x, y: jnp.dot(x.T, y), lambda x, y: at_b(x[None], y[None])[0],
       Layout.TN, list(zip(a, d))),
  )


def _time_hopper(layout, tiles, args, reference):
  """(microseconds, whether the bits equal ``reference``) of one Hopper config."""
  fn = functools.partial(hopper.matmul, layout=layout, out_dtype=jnp.bfloat16,
                         tiles=kernels.fit_stages(tiles, bf16, bf16))
  same = np.array_equal(np.asarray(fn(*args[0])).view(np.uint16), reference)
  return bench.time_us(fn, args), same


def hopper_sweep(m_values):
  """XLA, the Triton kernel the ladder picks, and each Hopper candidate: time
  (XLA/kernel) and whether the candidate's bits equal the Triton kernel's."""
  print(f"# Hopper kernel sweep on {bench.device_description()}")
  print("| pass | M | K | N | XLA us | Triton us | "
        + " | ".join(f"strip dim {c.strip_dim} width {c.strip_width}"
                     for c in HOPPER_CANDIDATES) + " |")
  print("|---" * (6 + len(HOPPER_CANDIDATES)) + "|")
  for m in m_values:
    for k, n in HOPPER_KN:
      for pass_, xla_fn, triton_fn, layout, args in _hopper_passes(m, k, n):
        xla = bench.time_us(xla_fn, args)
        triton_us = bench.time_us(triton_fn, args)
        reference = np.asarray(triton_fn(*args[0])).view(np.uint16)
        cells = []
        for tiles in HOPPER_CANDIDATES:
          us, same = _time_hopper(layout, tiles, args, reference)
          cells.append(f"{us:.1f} ({xla / us:.2f}x){'' if same else ' BITS DIFFER'}")
        print(f"| {pass_} | {m} | {k} | {n} | {xla:.1f} | {triton_us:.1f} "
              f"({xla / triton_us:.2f}x) | " + " | ".join(cells) + " |", flush=True)


def row_tile_sweep(m_values):
  """Forward and dA at each M: XLA, the plan's pick (a Hopper tile or the
  Triton ladder's) and every Hopper forward/dA tile (XLA time / kernel time;
  bits against the pick)."""
  name = lambda t: f"{t.block_m}x{t.block_cols}"
  print(f"# Hopper forward/dA tile sweep on {bench.device_description()}")
  print("| pass | M | K | N | XLA us | pick | "
        + " | ".join(name(t) for t in hopper.ROW_TILES) + " |")
  print("|---" * (6 + len(hopper.ROW_TILES)) + "|")
  for m in m_values:
    for k, n in HOPPER_KN:
      for pass_, xla_fn, triton_fn, layout, args in _hopper_passes(m, k, n)[:2]:
        cols, depth = (n, k) if layout is Layout.NN else (k, n)
        plan = matmul_plan.plan(layout, m, cols, depth, dtype=bf16, out_dtype=bf16)
        pick = plan.tiles if plan.kernel is matmul_plan.Kernel.MOSAIC_GPU else None
        pick_fn = (functools.partial(hopper.matmul, layout=layout, out_dtype=jnp.bfloat16,
                                     tiles=pick) if pick else triton_fn)
        xla = bench.time_us(xla_fn, args)
        reference = np.asarray(pick_fn(*args[0])).view(np.uint16)
        times = {}
        cells = []
        for tiles in hopper.ROW_TILES:
          times[tiles], same = _time_hopper(layout, tiles, args, reference)
          times[kernels.fit_stages(tiles, bf16, bf16)] = times[tiles]
          cells.append(f"{xla / times[tiles]:.2f}{'' if same else ' BITS DIFFER'}")
        pick_us = times[pick] if pick else bench.time_us(pick_fn, args)
        pick_name = name(pick) if pick else "Triton ladder"
        print(f"| {pass_} | {m} | {k} | {n} | {xla:.1f} | {pick_name} {xla / pick_us:.2f} | "
              + " | ".join(cells) + " |", flush=True)


def _ladder_candidates(m):
  return LADDER_CANDIDATES[max(key for key in LADDER_CANDIDATES if key <= m)]


def ladder_sweep(m_values, weights=HOPPER_KN):
  """Forward and dA at each M and weight: XLA, the tile the ladder picks, and every
  candidate of LADDER_CANDIDATES (XLA time / kernel time; bits against the pick)."""
  name = lambda t: f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
  print(f"# GEMM tile sweep on {bench.device_description()}")
  print("| pass | M | K | N | XLA us | ladder pick | best | candidates |\n" + "|---" * 8 + "|")
  triton = functools.partial(kernels.matmul, out_dtype=jnp.bfloat16, precision=None,
                             interpret=False)
  for k, n in weights:
    for transpose_b in (False, True):  # dA contracts over N and returns [M, K]
      cols, depth = (k, n) if transpose_b else (n, k)
      b_shape = (1, cols, depth) if transpose_b else (1, depth, cols)
      bs = [random_normal(i, b_shape, jnp.bfloat16) for i in range(COPIES)]
      for m in m_values:
        a = [random_normal(10 + i, (1, m, depth), jnp.bfloat16) for i in range(COPIES)]
        args = list(zip(a, bs))
        xla = bench.time_us(
            lambda x, y: jnp.dot(x[0], y[0].T if transpose_b else y[0]), args)
        pick = matmul_plan.triton_tiles(Layout.NN, m, cols, bf16, bf16)
        reference = np.asarray(triton(*args[0], transpose_b=transpose_b, tiles=pick))
        results = []
        for tiles in [pick, *_ladder_candidates(m)]:
          fn = functools.partial(triton, transpose_b=transpose_b, tiles=tiles)
          same = np.array_equal(np.asarray(fn(*args[0])).view(np.uint16),
                                reference.view(np.uint16))
          results.append((xla / bench.time_us(fn, args), tiles, same))
        best = max(results[1:], key=lambda r: r[0])
        cells = ", ".join(f"{name(t)} {r:.2f}{'' if same else ' BITS DIFFER'}"
                          for r, t, same in results[1:])
        print(f"| {'dA' if transpose_b else 'fwd'} | {m} | {k} | {n} | {xla:.1f} | "
              f"{name(pick)} {results[0][0]:.2f} | {name(best[1])} {best[0]:.2f} | {cells} |",
              flush=True)


def at_b_sweep(m=1024):
  """dB (Triton kernel) at one M, each ladder tile at its own stages: they may depend
  on K and N only (the plan's pick is marked)."""
  print("| pass | M | K | N | tiles | plan's | us | XLA us | XLA/jdet |\n" + "|---" * 9 + "|")
  for k, n in HOPPER_KN:
    a = random_normal(0, (1, m, k), jnp.bfloat16)
    d = random_normal(2, (1, m, n), jnp.bfloat16)
    xla = bench.time_us(lambda x, y: jnp.dot(x.T, y), [(a[0], d[0])])
    picked = matmul_plan.triton_tiles(
        Layout.TN, k, n, bf16, bf16,
        num_sms=matmul_plan.Device.current().sm_count or kernels.H100_SM_COUNT)
    for tiles in kernels.GPU_MATMUL_LADDER:
      tiles = kernels.fit_stages(tiles, bf16, bf16)
      fn = functools.partial(kernels.matmul_at_b, out_dtype=jnp.bfloat16, precision=None,
                             tiles=tiles, interpret=False)
      us = bench.time_us(fn, [(a, d)])
      print(f"| dB | {m} | {k} | {n} | {tiles} | {'yes' if tiles == picked else ''} | "
            f"{us:.1f} | {xla:.1f} | {xla / us:.2f} |",
            flush=True)


def _plan_name(plan: matmul_plan.Plan) -> str:
  """A plan's kernel and tile: ``mosaic T96x256 mc2`` (transposed, clusters of 2)."""
  t = plan.tiles
  split = " split" if plan.split_chunks else ""
  if isinstance(t, hopper.HopperTiles):
    return (f"mosaic {'T' if t.transposed else ''}{t.block_m}x{t.block_cols}"
            + (f" mc{t.cluster_size}" if t.multicast else "") + split)
  return (f"triton {t.block_m}x{t.block_n} s{t.num_stages}"
          + (f" k{t.step_k}" if t.step_k != BLOCK_K else "") + split)


def _forward_fn(plan: matmul_plan.Plan):
  return lambda x, y: matmul_plan.launch(plan, x[None], y[None], layout=Layout.NN,
                                         out_dtype=bf16)[0]


def candidate_plans(m, k, n, mosaic_count=MOSAIC_CANDIDATES):
  """The forward plans a rule could choose at an m x n result over k: the
  ``mosaic_count`` Mosaic GPU tiles of least estimated time (at any row count:
  ``hopper_matmul.LADDER_ROWS`` is one of the rules under test), the Triton
  ladder's tiles of at least min(m, GPU_ONE_ROW_OF_TILES) rows (smaller ones
  re-read the weight), and a chunked contraction's split; all with the
  contract's chunks."""
  pick = matmul_plan.plan(Layout.NN, m, n, k, dtype=bf16, out_dtype=bf16)
  chunk, chunked = pick.contraction_chunk, pick.contraction_chunk is not None
  plans = []
  if hopper.takes(Layout.NN, m, n, k):
    lhs_aligned, rhs_aligned = hopper.lines_aligned(Layout.NN, m, n, k)
    estimates = matmul_plan.mosaic_tile_estimates(
        m, n, matmul_plan.Device.current().sm_count or kernels.H100_SM_COUNT,
        lhs_aligned=lhs_aligned, rhs_aligned=rhs_aligned, transposed=True, chunked=chunked)
    for tiles in sorted(estimates, key=estimates.get)[:mosaic_count]:
      tiles = kernels.fit_stages(matmul_plan.mosaic_strips(tiles, m, n, k), bf16, bf16)
      plans.append(matmul_plan.Plan(matmul_plan.Kernel.MOSAIC_GPU, tiles,
                                    contraction_chunk=chunk))
  plans += [matmul_plan.Plan(matmul_plan.Kernel.PALLAS_TRITON,
                             kernels.fit_stages(t, bf16, bf16), contraction_chunk=chunk)
            for t in kernels.GPU_MATMUL_LADDER
            if t.block_m >= min(m, kernels.GPU_ONE_ROW_OF_TILES)
            and (not chunked or kernels.holds_two_accumulators(t))]
  if chunked:
    plans.append(matmul_plan.plan(Layout.NN, m, n, k, dtype=bf16, out_dtype=bf16,
                                  split_chunks=True))
  return pick, [p for p in dict.fromkeys(plans) if p != pick]


def candidate_sweep(m_values, weights):
  """Forward at each M and weight: XLA, the plan's pick, and every plan of
  :func:`candidate_plans` (XLA time / kernel time; bits against the pick)."""
  print(f"# Forward candidate sweep on {bench.device_description()}")
  print("| M | K | N | chunk | XLA us | pick | best | candidates |\n" + "|---" * 8 + "|")
  for k, n in weights:
    bs = [random_normal(i, (k, n), jnp.bfloat16) for i in range(COPIES)]
    for m in m_values:
      args = list(zip([random_normal(10 + i, (m, k), jnp.bfloat16) for i in range(COPIES)], bs))
      xla = bench.time_us(jnp.dot, args)
      pick, others = candidate_plans(m, k, n)
      reference = np.asarray(_forward_fn(pick)(*args[0])).view(np.uint16)
      pick_ratio = xla / bench.time_us(_forward_fn(pick), args)
      cells = []
      for plan in others:
        same = np.array_equal(np.asarray(_forward_fn(plan)(*args[0])).view(np.uint16),
                              reference)
        cells.append((xla / bench.time_us(_forward_fn(plan), args), plan, same))
      best = max(cells, key=lambda c: c[0], default=(pick_ratio, pick, True))
      print(f"| {m} | {k} | {n} | {pick.contraction_chunk} | {xla:.1f} | "
            f"{_plan_name(pick)} {pick_ratio:.2f} | {_plan_name(best[1])} {best[0]:.2f} | "
            + ", ".join(f"{_plan_name(p)} {r:.2f}{'' if same else ' BITS DIFFER'}"
                        for r, p, same in cells) + " |", flush=True)


def split_sweep(m_values, weights=SPLIT_KN):
  """Forward of chunked GEMMs at each M: XLA, the chunks inside each program (the
  plan's in-program kernel and tiles) and on programs of their own (XLA time /
  kernel time, in-program time / split time, and whether the bits agree)."""
  print(f"# Chunk split sweep on {bench.device_description()}")
  print("| pass | M | K | N | chunk | XLA us | in-program | split | in-program / split | bits |\n"
        + "|---" * 10 + "|")
  for k, n in weights:
    bs = [random_normal(i, (k, n), jnp.bfloat16) for i in range(COPIES)]
    for m in m_values:
      args = list(zip([random_normal(10 + i, (m, k), jnp.bfloat16) for i in range(COPIES)], bs))
      plans = [matmul_plan.plan(Layout.NN, m, n, k, dtype=bf16, out_dtype=bf16,
                                split_chunks=split) for split in (False, True)]
      fns = [_forward_fn(p) for p in plans]
      same = np.array_equal(*(np.asarray(fn(*args[0])).view(np.uint16) for fn in fns))
      xla = bench.time_us(jnp.dot, args)
      in_us, split_us = (bench.time_us(fn, args) for fn in fns)
      print(f"| fwd | {m} | {k} | {n} | {plans[0].contraction_chunk} | {xla:.1f} | "
            f"{_plan_name(plans[0])} {xla / in_us:.2f} | {_plan_name(plans[1])} "
            f"{xla / split_us:.2f} | {in_us / split_us:.2f} | {'same' if same else 'DIFFER'} |",
            flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--m", type=int, nargs="+", default=sorted(LADDER_CANDIDATES),
                      help="ladder sweep at these M (M >= 1)")
  parser.add_argument("--kn", type=int, nargs=2, action="append", metavar=("K", "N"),
                      help="a weight of the ladder or split sweep (repeatable; default "
                           "HOPPER_KN or SPLIT_KN)")
  parser.add_argument("--hopper-m", type=int, nargs="+",
                      help="sweep the Hopper kernel's configs at these M instead")
  parser.add_argument("--row-tiles-m", type=int, nargs="+",
                      help="sweep the Hopper kernel's forward/dA tiles at these M instead")
  parser.add_argument("--at-b", action="store_true",
                      help="sweep the Triton dB kernel's tiles at M = 1024 instead")
  parser.add_argument("--split-m", type=int, nargs="+",
                      help="time chunks in-program and split at these M instead")
  parser.add_argument("--candidates-m", type=int, nargs="+",
                      help="time every plan a rule could choose for the forward at these M "
                           "over the --kn weights instead")
  args = parser.parse_args()
  weights = [tuple(kn) for kn in args.kn] if args.kn else None
  if args.candidates_m:
    if not weights:
      parser.error("--candidates-m needs at least one --kn K N")
    candidate_sweep(args.candidates_m, weights)
  elif args.split_m:
    split_sweep(args.split_m, weights or SPLIT_KN)
  elif args.hopper_m:
    hopper_sweep(args.hopper_m)
  elif args.row_tiles_m:
    row_tile_sweep(args.row_tiles_m)
  elif args.at_b:
    at_b_sweep()
  else:
    ladder_sweep(args.m, weights or HOPPER_KN)


if __name__ == "__main__":
  main()
