"""`python -m jdet check --trials N --seed S`: the seeded invariance fuzz passes on
every op, and catches an op whose rows depend on the batch, with a repro that replays."""

import re

import jax.numpy as jnp
import pytest

import jdet
from jdet import __main__ as cli
from jdet import fuzz
from jdet.bench import on_gpu

pytestmark = pytest.mark.skipif(on_gpu(), reason="CPU-sized trials; on a GPU run python -m jdet")


def test_a_trial_of_every_op_passes(capsys):
  ops = [arg for op in fuzz.GENERATORS for arg in ("--op", op)]
  assert cli.main(["check", "--trials", "1", "--seed", "1", *ops]) == 0
  out = capsys.readouterr().out
  for op in fuzz.GENERATORS:
    assert f"{op}: 1 of 1 trials passed" in out
  assert "ok: 0 failed trials" in out


def test_a_batch_dependent_op_is_caught_with_a_repro_that_replays(monkeypatch, capsys):
  def leaky(logits, **options):  # each row scaled by the batch's leading size
    x = jnp.asarray(logits, jnp.float32)
    return x * x.shape[0]

  monkeypatch.setattr(jdet, "sinkhorn", leaky)
  assert cli.main(["check", "--op", "sinkhorn", "--trials", "4", "--seed", "0"]) == 1
  out = capsys.readouterr().out
  repro = re.search(r"REPRO: python -c \"import jdet.fuzz as f; "
                    r"f.run_trial\('sinkhorn', seed=0, index=(\d+)\)\"", out)
  assert repro, out
  failure = re.search(r"sinkhorn trial \d+ \(seed 0\) failed: (sinkhorn logits \[.*?\]"
                      r".*?transform=\w+/\w+; rows .*)", out)
  assert failure and "differs" in failure.group(1), out
  with pytest.raises(AssertionError, match=re.escape(failure.group(1)[:80])):
    fuzz.run_trial("sinkhorn", seed=0, index=int(repro.group(1)))


def test_trials_are_seeded_per_op_and_index():
  first = fuzz.trial_rng("matmul", 3, 7).standard_normal(4)
  assert (first == fuzz.trial_rng("matmul", 3, 7).standard_normal(4)).all()
  assert not (first == fuzz.trial_rng("sinkhorn", 3, 7).standard_normal(4)).all()
  assert not (first == fuzz.trial_rng("matmul", 3, 8).standard_normal(4)).all()


def test_a_pool_repeats_cases_and_its_repro_names_it(monkeypatch, capsys):
  """With --pool 2, trials 0 and 2 draw the same case (shapes, dtypes, options) and
  different data; a failure's repro carries the pool and replays."""
  case = lambda index: fuzz.make_trial("softmax", 5, index, pool=2).case_rng.integers(1 << 30)
  data = lambda index: fuzz.make_trial("softmax", 5, index, pool=2).rng.integers(1 << 30)
  assert case(0) == case(2) != case(1) and data(0) != data(2)

  def leaky(logits, **options):
    x = jnp.asarray(logits, jnp.float32)
    return x * x.shape[0]

  monkeypatch.setattr(jdet, "sinkhorn", leaky)
  assert cli.main(["check", "--op", "sinkhorn", "--trials", "3", "--seed", "0",
                   "--pool", "2"]) == 1
  out = capsys.readouterr().out
  assert "cases from a pool of 2 per op" in out
  repro = re.search(r"f.run_trial\('sinkhorn', seed=0, index=(\d+), pool=2\)", out)
  assert repro, out
  with pytest.raises(AssertionError, match="differs"):
    fuzz.run_trial("sinkhorn", seed=0, index=int(repro.group(1)), pool=2)


@pytest.mark.parametrize("pool", [None, 3])
def test_shards_split_the_trials_and_each_meets_every_pool_case(pool):
  shards = [fuzz.shard_indices(20, pool, shard, 4) for shard in range(4)]
  assert sorted(i for shard in shards for i in shard) == list(range(20))
  if pool:  # whole rounds of the pool: each shard with trials sees every case
    assert all({i % pool for i in shard} == {0, 1, 2} for shard in shards if shard)


def test_trials_in_worker_processes_report_per_op(capsys):
  assert cli.main(["check", "--op", "softmax", "--trials", "4", "--pool", "2",
                   "--workers", "2"]) == 0
  out = capsys.readouterr().out
  assert "2 worker processes" in out and "softmax: 4 of 4 trials passed" in out
