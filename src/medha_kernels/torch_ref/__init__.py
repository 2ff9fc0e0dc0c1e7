"""The ``torch`` backend: plain-torch reference implementations, any device.

Arithmetic is in fp32 whatever the input dtype (float64 stays float64), and
results are cast back at the end. Long KV is processed in tiles whose partial
states are merged exactly, so memory stays bounded.
"""

from __future__ import annotations

import torch

from medha_kernels.torch_ref.attention import chunked_prefill_attention as chunked_prefill_attention
from medha_kernels.torch_ref.attention import paged_attention as paged_attention
from medha_kernels.torch_ref.attention import plan_paged_attention as plan_paged_attention
from medha_kernels.torch_ref.merge import merge_state as merge_state
from medha_kernels.torch_ref.merge import merge_state_in_place as merge_state_in_place
from medha_kernels.torch_ref.merge import merge_states as merge_states
from medha_kernels.torch_ref.paged_kv import append_paged_kv as append_paged_kv


def supports_device(device: torch.device) -> bool:
    return True
