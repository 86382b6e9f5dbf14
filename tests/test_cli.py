"""The `python -m jdet` report commands and the training example run and say the truth."""

import collections
import os
import runpy

import pytest

import dataclasses

from jdet import __main__ as cli
from jdet._registry import OPS
from jdet.bench import on_gpu

# On a GPU these commands run production sizes for minutes: run them directly there.
pytestmark = pytest.mark.skipif(on_gpu(), reason="CPU-sized report; on a GPU run python -m jdet")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_check_of_every_op_passes_and_prints_a_table(capsys):
  # Every op by name: the model parity check that a bare `check` adds runs in
  # tests/test_rl_parity.py (and below, stubbed).
  assert cli.main(["check", *(f"--op={op}" for op in OPS)]) == 0
  out = capsys.readouterr().out
  for row in ("| matmul | fwd bf16", "| sinkhorn | grad=implicit n=8", "| tri_inverse | dA n=64"):
    assert row in out
  count = sum(len(op.check_cases(False)) for op in OPS.values())
  assert f"{count} passed, 0 failed" in out


def test_check_in_worker_processes_gives_the_table_in_registry_order(capsys):
  assert cli.main(["check", "--op", "softmax", "--workers", "2"]) == 0
  out = capsys.readouterr().out
  labels = [f"| {case.op} | {case.label} |" for case in OPS["softmax"].check_cases(False)]
  assert "2 worker processes" in out
  assert [out.index(label) for label in labels] == sorted(out.index(label) for label in labels)
  assert f"{len(labels)} passed, 0 failed" in out


@pytest.mark.parametrize("parity_ok", [True, False])
def test_bare_check_adds_the_model_parity_check(monkeypatch, capsys, parity_ok):
  from jdet.models import parity
  matmul = OPS["matmul"]
  monkeypatch.setitem(OPS, "matmul", dataclasses.replace(
      matmul, check_cases=lambda full: matmul.check_cases(full)[:1]))
  for name in [name for name in OPS if name != "matmul"]:
    monkeypatch.delitem(OPS, name)
  monkeypatch.setattr(parity, "parity_check", lambda config, **options: {"ok": parity_ok})
  assert cli.main(["check"]) == (0 if parity_ok else 1)
  assert ("2 passed, 0 failed" if parity_ok else "1 passed, 1 failed") in capsys.readouterr().out


def test_check_exits_1_when_a_case_fails(monkeypatch, capsys):
  matmul = OPS["matmul"]

  def broken_cases(full):
    cases = matmul.check_cases(full)
    cases[0].tolerance = 0.0  # no real GEMM meets a zero tolerance
    return cases[:1]

  monkeypatch.setitem(OPS, "matmul", dataclasses.replace(matmul, check_cases=broken_cases))
  assert cli.main(["check", "--op", "matmul"]) == 1
  assert "FAIL" in capsys.readouterr().out


def test_bench_writes_markdown_and_plot_and_warns_on_cpu(tmp_path, capsys):
  assert cli.main(["bench", "--op", "matmul", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "interpret mode" in out
  table = (tmp_path / "results.md").read_text()
  assert "| matmul | M=1 K=64 N=128 | fwd |" in table
  assert "TFLOP/s" not in table and "HBM" not in table  # no GPU columns on a CPU
  assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_first_call_times_fresh_sizes(tmp_path, capsys):
  """--first-call writes one row per case and pass, each pass at four sizes that no
  other pass and no bench case uses, the first size's rows marked as the process's
  warm-up."""
  for op in OPS.values():
    for full in (False, True):
      labels_of_pass = collections.defaultdict(set)
      for case in op.first_call_cases(full):
        labels_of_pass[case.pass_].add(case.case)
      seen = {c.case for c in op.bench_cases(full)}
      for pass_, labels in labels_of_pass.items():
        assert len(labels) == 4 and not labels & seen, (op.name, full, pass_, labels)
        seen |= labels
  assert cli.main(["bench", "--first-call", "--op", "matmul", "--out", str(tmp_path)]) == 0
  table = (tmp_path / "first_call.md").read_text()
  rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| matmul")]
  assert [r[2].strip() for r in rows] == (["fwd warm-up call", "fwd+bwd warm-up call"]
                                          + ["fwd first call", "fwd+bwd first call"] * 3)
  assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)


def test_training_example_is_invariant_with_jdet_only():
  example = runpy.run_path(os.path.join(ROOT, "examples", "train_invariant.py"))
  outcome = example["main"](steps=2)
  assert outcome["jdet"] == 0
  assert outcome["jnp baseline"] > 0


def test_worker_processes_get_their_environment_and_leave_the_callers_alone():
  from jdet import _workers
  before = dict(os.environ)
  with _workers.worker_pool(1) as pool:
    for name, value in _workers.WORKER_ENVIRONMENT.items():
      assert pool.submit(os.getenv, name).result() == value, name
  assert dict(os.environ) == before
