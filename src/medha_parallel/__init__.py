"""medha_parallel (see README for status)."""
