// Decoding on the CPU, one token per row per step: the two things XLA:CPU does slowly there,
// called through the XLA FFI (models/attention/cpu_kernel.py: skinny_matmul and
// decode_attention; models/decode.py turns them on while it decodes).
//
// ZooSkinnyMatmul: y (M, N) = x (M, K) . w (K, N), float32, for a few rows (M = the batch).
//   A decoding step is a chain of such products whose weights (137 MB at d = 8) come from
//   memory once per step, so the step's time is how fast w streams in. XLA's dot streamed
//   it at 8-10 GB/s for 8 rows on the 2-core CI machine. This kernel reads w row after row,
//   8 rows of w at a time: each thread owns a contiguous range of columns, so it reads 8
//   contiguous streams (what the hardware prefetcher follows best), and its rows of y stay
//   in L1/L2 while it adds x[m, k..k+7] * w[k..k+7, c] into them.
//
// ZooDecodeAttention: softmax attention of one query per (row, head) over a cache read in
//   place: q (B, H, D); cache keys and values (B, H, C, D); allowed (H, C) uint8 (which
//   slots each head may attend to at this step); live (int32 scalar): only slots < live are
//   read (the rest are empty). XLA copied the cache's live slots before its two products;
//   here each (row, head) reads its own keys and values once. A (row, head) that may attend
//   to nothing gets 0. Returns o (B, H, D).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using zoo_cpu::exp_nonpositive;
using zoo_cpu::Helpers;
using zoo_cpu::ParallelFor;
using zoo_cpu::Store;

// Sixteen floats in one SIMD register where the CPU has them (AVX-512), two or four
// otherwise (GCC/Clang vector extension).
typedef float v16 __attribute__((vector_size(64)));

inline v16 Load(const float* p) { return zoo_cpu::LoadVector<v16>(p); }

constexpr int kRows = 8;   // Rows of x (and y) per pass over w.
constexpr int kDepth = 8;  // Rows of w read together (contiguous streams).
constexpr int kLanes = 16;

// y[0..MR, c0..c1) = x[0..MR, :] . w[:, c0..c1), for c1 - c0 a multiple of kLanes.
template <int MR>
void Columns(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t c0,
             int64_t c1) {
  for (int m = 0; m < MR; ++m) std::memset(y + m * N + c0, 0, (c1 - c0) * sizeof(float));
  int64_t k = 0;
  for (; k + kDepth <= K; k += kDepth) {
    const float* wk = w + k * N;
    for (int64_t c = c0; c < c1; c += kLanes) {
      v16 wv[kDepth];
      for (int i = 0; i < kDepth; ++i) wv[i] = Load(wk + i * N + c);
      for (int m = 0; m < MR; ++m) {
        v16 acc = Load(y + m * N + c);
        const float* xm = x + m * K + k;
        for (int i = 0; i < kDepth; ++i) acc += xm[i] * wv[i];
        Store(y + m * N + c, acc);
      }
    }
  }
  for (; k < K; ++k) {
    const float* wk = w + k * N;
    for (int64_t c = c0; c < c1; c += kLanes) {
      const v16 wv = Load(wk + c);
      for (int m = 0; m < MR; ++m) Store(y + m * N + c, Load(y + m * N + c) + x[m * K + k] * wv);
    }
  }
}

// The same for columns [c0, c1) fewer than kLanes wide (the tail of an odd width).
void TailColumns(int rows, const float* x, int64_t K, const float* w, int64_t N, float* y,
                 int64_t c0, int64_t c1) {
  for (int m = 0; m < rows; ++m) {
    for (int64_t c = c0; c < c1; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * w[k * N + c];
      y[m * N + c] = acc;
    }
  }
}

void RowBlock(int rows, const float* x, int64_t K, const float* w, int64_t N, float* y,
              int64_t c0, int64_t c1) {
  switch (rows) {
    case 1: Columns<1>(x, K, w, N, y, c0, c1); break;
    case 2: Columns<2>(x, K, w, N, y, c0, c1); break;
    case 3: Columns<3>(x, K, w, N, y, c0, c1); break;
    case 4: Columns<4>(x, K, w, N, y, c0, c1); break;
    case 5: Columns<5>(x, K, w, N, y, c0, c1); break;
    case 6: Columns<6>(x, K, w, N, y, c0, c1); break;
    case 7: Columns<7>(x, K, w, N, y, c0, c1); break;
    default: Columns<8>(x, K, w, N, y, c0, c1); break;
  }
}

ffi::Error SkinnyMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, int64_t threads,
                            ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("skinny matmul takes x (M, K) and w (K, N)");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Each part is a contiguous range of whole vectors of columns; the tail (N mod 16) goes
  // with the last part.
  const int64_t vectors = N / kLanes;
  const int64_t parts = std::max<int64_t>(1, std::min(threads, vectors));
  Helpers helpers(&pool);
  ParallelFor(parts, parts, helpers, [&](int64_t part) {
    const int64_t c0 = vectors * part / parts * kLanes;
    const int64_t c1 = vectors * (part + 1) / parts * kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      if (c1 > c0) RowBlock(rows, xp + m0 * K, K, wp, N, yp + m0 * N, c0, c1);
      if (part == parts - 1 && c1 < N) TailColumns(rows, xp + m0 * K, K, wp, N, yp + m0 * N, c1, N);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> allowed,
                               ffi::Buffer<ffi::S32> live, float scale, int64_t threads,
                               ffi::ResultBuffer<ffi::F32> o, ffi::ThreadPool pool) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[2]) {
    return ffi::Error::InvalidArgument(
        "decode attention takes q (B, H, D) and a cache (B, H, capacity, D)");
  }
  const int64_t B = qd[0], H = qd[1], D = qd[2], C = kd[2];
  if (static_cast<int64_t>(allowed.element_count()) != H * C) {
    return ffi::Error::InvalidArgument("allowed must be (heads, capacity)");
  }
  const int64_t n = std::clamp<int64_t>(live.typed_data()[0], 0, C);
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const uint8_t* ap = allowed.typed_data();
  float* op = o->typed_data();
  Helpers helpers(&pool);
  ParallelFor(B * H, threads, helpers, [&](int64_t item) {
    const int64_t h = item % H;
    const float* qi = qp + item * D;
    const float* ki = kp + item * C * D;
    const float* vi = vp + item * C * D;
    const uint8_t* ai = ap + h * C;
    float* oi = op + item * D;
    std::vector<float> p(n);
    float top = -1e30f;
    bool any = false;
    for (int64_t c = 0; c < n; ++c) {
      if (!ai[c]) continue;
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s += qi[d] * ki[c * D + d];
      p[c] = s * scale;
      top = any ? std::max(top, p[c]) : p[c];
      any = true;
    }
    std::fill(oi, oi + D, 0.0f);
    if (!any) return;
    float total = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      p[c] = ai[c] ? exp_nonpositive(p[c] - top) : 0.0f;
      total += p[c];
    }
    for (int64_t c = 0; c < n; ++c) {
      if (p[c] == 0.0f) continue;
      const float pc = p[c];
      for (int64_t d = 0; d < D; ++d) oi[d] += pc * vi[c * D + d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) oi[d] *= inv;
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooSkinnyMatmul, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w (K, N)
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cached keys (B, H, C, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cached values
                                  .Arg<ffi::Buffer<ffi::U8>>()   // allowed (H, C)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live: slots read
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o (B, H, D)
                                  .Ctx<ffi::ThreadPool>());
