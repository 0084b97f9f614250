"""Phase computers: the DMD2 computer and a small reference computer for tests and benchmarks."""
