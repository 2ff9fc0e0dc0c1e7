"""medha_sched: pure-Python scheduling for long-context LLM inference."""
