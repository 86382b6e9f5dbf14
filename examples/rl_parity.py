"""RL with bitwise sampler/trainer parity: a Llama-style model sampled and trained on jdet.

An RL loop samples completions with a KV cache (prefill, then one decode step
per token, in batches whose size changes from round to round and whose
sequences finish at different times) and records the sampler's log-probs. The
trainer then recomputes the same tokens' log-probs on whole sequences, in other
batches. Importance ratios exp(logp_trainer - logp_sampler) are exactly 1 only
if the two agree bit for bit. With jdet's ops they do, and each example's GRPO
gradient is the same in any batch; with XLA's ops the report says how far they
drift (on a GPU; XLA:CPU can happen to agree at the tiny CPU sizes).

Run: ``python examples/rl_parity.py`` (CPU: small model, interpret-mode kernels,
a few minutes) or ``--config gpu``; the default picks by backend. Exits 1 when
jdet's parity fails. The work is ``jdet.models.parity.parity_check``.
"""

from __future__ import annotations

import argparse
import sys

from jdet.bench import on_gpu
from jdet.models import parity


def main(config: str | None = None) -> dict:
  """Runs the check (``config``: "cpu", "gpu", or None for this backend) and returns
  its outcomes (see :func:`jdet.models.parity.parity_check`)."""
  if config is None:
    config = "gpu" if on_gpu() else "cpu"
  return parity.parity_check(config)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", choices=sorted(parity.SETUPS), default=None,
                      help="model and rollout sizes (default: gpu on a GPU, else cpu)")
  sys.exit(0 if main(parser.parse_args().config)["ok"] else 1)
