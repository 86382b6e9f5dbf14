"""Raw Pallas kernels behind jdet: no autodiff, no argument conveniences.

Each module holds one op family's kernels, its launcher (explicit tiles and an
``interpret`` flag) and its tile table with the measurement that chose it.
"""
