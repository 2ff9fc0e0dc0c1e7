// One thread reading a cold fp32 buffer at a set arithmetic pace, under software-prefetch
// policies: how fast can a core stream memory while it computes (issue 17, batch 32)?
//
//   g++ -O3 -mavx2 -mfma -mavx512f -mavx512vl -mavx512bw -mavx512dq -mprefer-vector-width=256
//       benchmarks/cpu_stream.cpp -o /tmp/cpu_stream   (the native kernels' flags)
//   /tmp/cpu_stream [MB=512] [reps=3] [substring of the variant names]
//
// The buffer (512 MB: as large as SmolLM2-135M's weights) is read once a pass, so every
// line comes from memory. Pace ("work"), per 64-byte line of 16 floats:
//   sum:  one 16-lane load and add (as `w.sum()`; the memory is the limit);
//   fma:  16 broadcasts x 2 FMAs (the pace of linear_cpu.cpp's ktask2 at 32 rows: a line
//         per ~16 cycles);
//   half: 16 broadcasts x 1 FMA (twice that pace).
// Layout of the reads:
//   S<n>:   n contiguous streams (the buffer cut in n parts) read a line from each in turn;
//   far:    one stream in tasks of W lines (W = 1008: one ktask2 task at K = 576); while a
//           task is read, the next task's lines are prefetched, one a line read, as x<n>
//           interleaved sub-streams (sub-stream s: the next task's s-th n-th), the
//           prefetch pointers in registers.
// Prefetch policies (S<n>): none; every line d lines ahead in its stream ("every T1 d32":
// prefetcht1, 32 lines); the first 1-2 lines of the page P pages ahead, at each page's
// start ("pagehead T1 P2 x1": to start the L2 streamer early, the rest left to it).
// Printed: GB/s read (thread CPU time, best of the passes; variants alternate pass by pass),
// the same loop's rate over a 1 MB L2-resident buffer (the pace), and their ratio.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

double thread_s() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

enum Policy { NONE, EVERY, PAGEHEAD };

struct Cfg {
  std::string name;
  int work;     // 0 sum, 1 fma, 2 half
  int streams;  // S<n>; 0 marks a far variant
  int policy;
  int hint;     // 0 T0, 1 T1, 2 T2, 3 NTA
  int dist;     // EVERY: lines ahead; PAGEHEAD: pages ahead; far: W
  int heads;    // PAGEHEAD: lines at the page's start; far: sub-streams
};

template <int HINT>
inline void pf(const char* p) {
  if constexpr (HINT == 0) _mm_prefetch(p, _MM_HINT_T0);
  else if constexpr (HINT == 1) _mm_prefetch(p, _MM_HINT_T1);
  else if constexpr (HINT == 2) _mm_prefetch(p, _MM_HINT_T2);
  else _mm_prefetch(p, _MM_HINT_NTA);
}

struct Acc {
  __m512 a[14][2];
};

template <int WORK>
inline void consume(const float* p, Acc& acc, __m512 x0, __m512 x1) {
  if constexpr (WORK == 0) {
    acc.a[0][0] = _mm512_add_ps(acc.a[0][0], _mm512_load_ps(p));
  } else {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __m512 b = _mm512_set1_ps(p[j]);
      acc.a[j % 14][0] = _mm512_fmadd_ps(b, x0, acc.a[j % 14][0]);
      if constexpr (WORK == 1) acc.a[j % 14][1] = _mm512_fmadd_ps(b, x1, acc.a[j % 14][1]);
    }
  }
}

float total(const Acc& acc) {
  __m512 t = _mm512_setzero_ps();
  for (int i = 0; i < 14; ++i) t = _mm512_add_ps(t, _mm512_add_ps(acc.a[i][0], acc.a[i][1]));
  return _mm512_reduce_add_ps(t);
}

// S<n>: lines [0, lines / n) of each of the n streams, one line of each in turn.
template <int WORK, int POL, int HINT>
float run_streams(const float* base, int64_t lines, const Cfg& c) {
  Acc acc;
  for (auto& r : acc.a) r[0] = r[1] = _mm512_setzero_ps();
  const __m512 x0 = _mm512_set1_ps(1.0001f), x1 = _mm512_set1_ps(0.9999f);
  const int S = c.streams;
  const int64_t per = lines / S;
  const char* lim = reinterpret_cast<const char*>(base + lines * 16);
  for (int64_t l = 0; l < per; ++l) {
    for (int s = 0; s < S; ++s) {
      const float* p = base + (s * per + l) * 16;
      if constexpr (POL == EVERY) {
        const char* q = reinterpret_cast<const char*>(p + c.dist * 16);
        if (q < lim) pf<HINT>(q);
      } else if constexpr (POL == PAGEHEAD) {
        if ((reinterpret_cast<uintptr_t>(p) & 4095) == 0) {
          const char* q = reinterpret_cast<const char*>(p) + c.dist * 4096;
          for (int h = 0; h < c.heads; ++h)
            if (q + 64 * h < lim) pf<HINT>(q + 64 * h);
        }
      }
      consume<WORK>(p, acc, x0, x1);
    }
  }
  return total(acc);
}

// far: tasks of W lines; task t + 1 prefetched (T1) during task t as SP sub-streams.
template <int WORK, int SP>
float run_far(const float* base, int64_t lines, const Cfg& c) {
  Acc acc;
  for (auto& r : acc.a) r[0] = r[1] = _mm512_setzero_ps();
  const __m512 x0 = _mm512_set1_ps(1.0001f), x1 = _mm512_set1_ps(0.9999f);
  const int64_t W = c.dist, ntask = lines / W;
  const char* lim = reinterpret_cast<const char*>(base + ntask * W * 16);
  for (int64_t t = 0; t < ntask; ++t) {
    const float* d = base + t * W * 16;
    const char* q[SP];
    for (int s = 0; s < SP; ++s) q[s] = reinterpret_cast<const char*>(d + (W + s * (W / SP)) * 16);
    for (int64_t i = 0; i + SP <= W; i += SP) {
#pragma GCC unroll 16
      for (int s = 0; s < SP; ++s) {
        if (q[s] < lim) _mm_prefetch(q[s], _MM_HINT_T1);
        q[s] += 64;
        consume<WORK>(d + (i + s) * 16, acc, x0, x1);
      }
    }
  }
  return total(acc);
}

template <int WORK, int POL>
float by_hint(const float* b, int64_t n, const Cfg& c) {
  switch (c.hint) {
    case 0: return run_streams<WORK, POL, 0>(b, n, c);
    case 1: return run_streams<WORK, POL, 1>(b, n, c);
    case 2: return run_streams<WORK, POL, 2>(b, n, c);
    default: return run_streams<WORK, POL, 3>(b, n, c);
  }
}

template <int WORK>
float by_policy(const float* b, int64_t n, const Cfg& c) {
  if (c.streams == 0) {
    switch (c.heads) {
      case 1: return run_far<WORK, 1>(b, n, c);
      case 2: return run_far<WORK, 2>(b, n, c);
      case 4: return run_far<WORK, 4>(b, n, c);
      case 8: return run_far<WORK, 8>(b, n, c);
      default: return run_far<WORK, 14>(b, n, c);
    }
  }
  switch (c.policy) {
    case NONE: return run_streams<WORK, NONE, 0>(b, n, c);
    case EVERY: return by_hint<WORK, EVERY>(b, n, c);
    default: return by_hint<WORK, PAGEHEAD>(b, n, c);
  }
}

float run(const float* b, int64_t n, const Cfg& c) {
  switch (c.work) {
    case 0: return by_policy<0>(b, n, c);
    case 1: return by_policy<1>(b, n, c);
    default: return by_policy<2>(b, n, c);
  }
}

// Lines a pass over n lines reads.
int64_t lines_read(int64_t n, const Cfg& c) {
  return c.streams == 0 ? n / c.dist * c.dist : n / c.streams * c.streams;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mb = argc > 1 ? atoll(argv[1]) : 512;
  const int reps = argc > 2 ? atoi(argv[2]) : 3;
  const char* filter = argc > 3 ? argv[3] : "";
  const int64_t bytes = mb << 20, lines = bytes / 64;
  float* buf = static_cast<float*>(aligned_alloc(4096, bytes));
  for (int64_t i = 0; i < bytes / 4; ++i) buf[i] = 1.0f + 1e-7f * static_cast<float>(i & 1023);
  const int64_t hot_bytes = 1 << 20, hot_lines = hot_bytes / 64;
  float* hot = static_cast<float*>(aligned_alloc(4096, hot_bytes));
  for (int64_t i = 0; i < hot_bytes / 4; ++i) hot[i] = 1.0f;

  const char* hint_name[] = {"T0", "T1", "T2", "NTA"};
  const char* work_name[] = {"sum", "fma", "half"};
  std::vector<Cfg> cfgs;
  for (int work : {0, 1, 2}) {
    const std::string w = std::string(work_name[work]) + " ";
    for (int S : {1, 2, 4, 14}) {
      const std::string s = w + "S" + std::to_string(S) + " ";
      cfgs.push_back({s + "none", work, S, NONE, 0, 0, 0});
      for (int h : {0, 1, 2, 3})
        for (int d : {16, 32, 64})
          cfgs.push_back({s + "every " + hint_name[h] + " d" + std::to_string(d), work, S, EVERY,
                          h, d, 0});
      for (int h : {1, 2})
        for (int P : {1, 2, 4})
          for (int heads : {1, 2})
            cfgs.push_back({s + "pagehead " + hint_name[h] + " P" + std::to_string(P) + " x" +
                                std::to_string(heads),
                            work, S, PAGEHEAD, h, P, heads});
    }
    for (int W : {1008, 224})
      for (int sp : {1, 2, 4, 8, 14})
        cfgs.push_back({w + "far W" + std::to_string(W) + " x" + std::to_string(sp), work, 0,
                        NONE, 1, W, sp});
  }
  std::vector<Cfg> sel;
  for (const Cfg& c : cfgs)
    if (strstr(c.name.c_str(), filter) != nullptr) sel.push_back(c);
  std::vector<double> cold(sel.size(), 1e30), warm(sel.size(), 1e30);
  volatile float sink = 0;
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < sel.size(); ++i) {
      double t = thread_s();
      for (int k = 0; k < 16; ++k) sink = sink + run(hot, hot_lines, sel[i]);
      warm[i] = std::min(warm[i], (thread_s() - t) / 16);
      t = thread_s();
      sink = sink + run(buf, lines, sel[i]);
      cold[i] = std::min(cold[i], thread_s() - t);
    }
  }
  printf("%-28s %8s %10s %9s\n", "variant", "GB/s", "hot GB/s", "cold/hot");
  for (size_t i = 0; i < sel.size(); ++i) {
    const double gbs = 64.0 * lines_read(lines, sel[i]) / cold[i] / 1e9;
    const double hgbs = 64.0 * lines_read(hot_lines, sel[i]) / warm[i] / 1e9;
    printf("%-28s %8.2f %10.2f %9.2f\n", sel[i].name.c_str(), gbs, hgbs, hgbs / gbs);
  }
  return 0;
}
