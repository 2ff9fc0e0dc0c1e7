"""medha_kernels: attention with LSE over a paged KV cache, and exact state merging.

Public ops (each takes ``backend="auto"``): :func:`merge_state`,
:func:`merge_state_in_place`, :func:`merge_states`,
:func:`chunked_prefill_attention`, :func:`paged_attention`,
:func:`append_paged_kv`; :func:`available_backends` lists what runs here.
:func:`linear` is ``F.linear`` with a native CPU path for decode batches,
:func:`rms_norm` transformers' RMSNorm (a residual add first) with one for fp32,
:func:`row_argmax` a greedy step's per-row arg-max with one for fp32 logits.
A step's layers share one :func:`plan_paged_attention` (validated once, no
host sync per layer), each calling :meth:`PagedAttentionPlan.run`.
LSE is natural-log fp32 ``[num_tokens, num_heads]``; an empty state is
``(0, -inf)``.
"""

from medha_kernels._checks import KernelInputError as KernelInputError
from medha_kernels.argmax import row_argmax as row_argmax
from medha_kernels.attention import chunked_prefill_attention as chunked_prefill_attention
from medha_kernels.attention import paged_attention as paged_attention
from medha_kernels.backends import available_backends as available_backends
from medha_kernels.linear import linear as linear
from medha_kernels.merge import merge_state as merge_state
from medha_kernels.merge import merge_state_in_place as merge_state_in_place
from medha_kernels.merge import merge_states as merge_states
from medha_kernels.norm import rms_norm as rms_norm
from medha_kernels.paged_kv import append_paged_kv as append_paged_kv
from medha_kernels.plan import PagedAttentionPlan as PagedAttentionPlan
from medha_kernels.plan import PagedHost as PagedHost
from medha_kernels.plan import plan_paged_attention as plan_paged_attention
from medha_kernels.plan import plan_paged_attention_from_host as plan_paged_attention_from_host
