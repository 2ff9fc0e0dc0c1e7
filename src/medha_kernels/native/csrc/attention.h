// Declarations for the CPU paged-attention kernel (attention_cpu.cpp).
//
// Shapes: q [N, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (NHD),
// q's dtype (fp32, fp16 or bf16), all contiguous; cu_seqlens_q [B + 1],
// kv_lens [B], q_start [B] (absolute position of each sequence's first query)
// and block_table [B, max_blocks], int32, contiguous, already validated.
// tasks [T, 5] int32 comes from plan_paged_attention_cpu for the same metadata.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace medha {

// The step's work list: (sequence, KV head, first token, end token, flag) rows,
// largest first; KV head -1 is a decode task (all KV heads of the sequence);
// flag of row 0 is 1 when the whole plan is too small to share across threads.
// Whether decode tasks are used depends on at::get_num_threads() at plan time.
at::Tensor plan_paged_attention_cpu(const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                                    const at::Tensor& q_start, int64_t num_kv_heads,
                                    int64_t group, bool causal);

// (o [N, Hq, D] in q's dtype, lse [N, Hq] fp32 natural log); a row that sees
// no key gets (0, -inf).
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens, const at::Tensor& q_start,
    const at::Tensor& block_table, const at::Tensor& tasks, bool causal, double sm_scale);

}  // namespace medha
