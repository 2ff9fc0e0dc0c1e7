"""The ``flashinfer`` backend: medha's ops on FlashInfer's CUDA kernels.

Importing this package never imports flashinfer; :func:`supports_device`
tries it once, lazily. Conventions are converted at the boundary (see
:mod:`.convert`): natural-log LSE <-> FlashInfer's base 2, block tables ->
CSR page indices, any ``q_offset`` -> bottom-right causal calls. Inputs
outside FlashInfer's limits (:mod:`.limits`: head_dim 64/128/256, fp16/bf16,
merge head counts, contiguous caches) raise :class:`FlashInferLimitError`;
:func:`can_run` answers the same question without raising, for "auto".
"""

from __future__ import annotations

import torch

from medha_kernels.flashinfer_adapter.limits import FlashInferLimitError as FlashInferLimitError
from medha_kernels.flashinfer_adapter.limits import can_run as can_run
from medha_kernels.flashinfer_adapter.ops import (
    chunked_prefill_attention as chunked_prefill_attention,
)
from medha_kernels.flashinfer_adapter.ops import load
from medha_kernels.flashinfer_adapter.ops import merge_state as merge_state
from medha_kernels.flashinfer_adapter.ops import merge_state_in_place as merge_state_in_place
from medha_kernels.flashinfer_adapter.ops import merge_states as merge_states
from medha_kernels.flashinfer_adapter.ops import paged_attention as paged_attention


def supports_device(device: torch.device) -> bool:
    """True only for a CUDA device, with CUDA present and ``import flashinfer`` succeeding."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and load() is not None
