"""Raw Pallas kernels behind jdet: no autodiff, no argument conveniences.

Each module holds one op family's kernels, its launcher (explicit tiles and an
``interpret`` flag) and its tile table with the measurement that chose it.
"""

from pallas_kernels._common import clear_interpret_executables, pad_axis, synchronous_cpu_dispatch

__all__ = ["clear_interpret_executables", "pad_axis", "synchronous_cpu_dispatch"]
