"""``@triton.jit`` kernels only; the launchers one level up pick grids, tiles and strides."""
