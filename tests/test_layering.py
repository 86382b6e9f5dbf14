"""The import graph points one way: benchmarks -> jdet -> pallas_kernels.

jdet imports only public modules and names of pallas_kernels, pallas_kernels
imports nothing of jdet, and neither imports the benchmarks scripts or the tests.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(package: str) -> list[tuple[str, str]]:
  """(file, dotted name) for every module and every name imported in
  ``package``'s modules (``from a.b import c`` gives ``a.b.c``)."""
  found = []
  for path in sorted((ROOT / package).rglob("*.py")):
    where = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(), where)):
      if isinstance(node, ast.Import):
        found += [(where, alias.name) for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        found += [(where, f"{node.module}.{alias.name}") for alias in node.names]
  return found


@pytest.mark.parametrize("package,forbidden", [
    ("jdet", ("benchmarks", "tests")),
    ("pallas_kernels", ("jdet", "benchmarks", "tests")),
])
def test_no_import_points_back_up(package, forbidden):
  back = [(f, m) for f, m in _imports(package) if m.split(".")[0] in forbidden]
  assert not back, back


def test_jdet_uses_only_public_pallas_kernels_names():
  private = [(f, m) for f, m in _imports("jdet")
             if m.startswith("pallas_kernels.")
             and any(part.startswith("_") for part in m.split(".")[1:])]
  assert not private, private
