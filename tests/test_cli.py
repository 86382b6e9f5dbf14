"""The `python -m jdet` report commands and the training example run and say the truth."""

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
  assert cli.main(["check"]) == 0
  out = capsys.readouterr().out
  for row in ("| matmul | fwd bf16", "| sinkhorn | grad=implicit n=8", "| tri_inverse | dA n=64"):
    assert row in out
  count = sum(len(op.check_cases(False)) for op in OPS.values())
  assert f"{count} passed, 0 failed" in out


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


def test_training_example_is_invariant_with_jdet_only():
  example = runpy.run_path(os.path.join(ROOT, "examples", "train_invariant.py"))
  outcome = example["main"](steps=2)
  assert outcome["jdet"] == 0
  assert outcome["jnp baseline"] > 0
