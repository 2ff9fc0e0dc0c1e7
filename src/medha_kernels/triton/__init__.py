"""The ``triton`` backend: Triton kernels for every op.

Runs on CUDA, and on CPU only under the Triton interpreter
(``TRITON_INTERPRET=1``), where 16-bit tiles are upcast to fp32 after loading
because the interpreter gets bf16 arithmetic wrong. Kernels (``@triton.jit``
only) live in :mod:`medha_kernels.triton.kernels`; the modules here launch them.
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (the backend is unavailable without Triton)

from medha_kernels.backends import triton_interpreting
from medha_kernels.triton.attention import chunked_prefill_attention as chunked_prefill_attention
from medha_kernels.triton.attention import paged_attention as paged_attention
from medha_kernels.triton.attention import plan_paged_attention as plan_paged_attention
from medha_kernels.triton.merge import merge_state as merge_state
from medha_kernels.triton.merge import merge_state_in_place as merge_state_in_place
from medha_kernels.triton.merge import merge_states as merge_states
from medha_kernels.triton.paged_kv import append_paged_kv as append_paged_kv


def supports_device(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreting()
