"""medha_kernels (see README for status)."""
