"""medha_runtime (see README for status)."""
