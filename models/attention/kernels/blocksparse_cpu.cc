// Block-sparse softmax attention on the CPU: a fused tile kernel called through the XLA FFI.
//
// XLA:CPU runs the small batched matmuls of a thin pattern (16-64 rows) at a fraction of its
// large-matmul speed and writes every score tile to memory between ops. This kernel walks a
// static tile layout (for each 16-query tile, the 16-key tiles the pattern touches, each
// either fully allowed or with a 16 x 16 mask) and keeps scores, probabilities and the running
// softmax statistics in registers / L1, as flash attention does on GPUs. Work and memory
// follow the layout's tiles, so they grow with the pattern, not with n^2.
//
// Layout of the operands (N items = batch x heads, sequences padded to a multiple of 16):
//   q, k, v (N, n, D)    row-major; q already multiplied by the logit scale;
//   seg (N, n) int32     document ids: query i sees key j only if seg[i] == seg[j];
//   row_ptr (n/16 + 1), col (E), mask_id (E), masks (M, 16 keys, 16 queries) uint8: the key
//   tiles of query tile t are col[row_ptr[t] .. row_ptr[t + 1]); mask_id -1 = every pair of
//   the tile allowed.
// Forward returns the normalized output o (N, n, D) and the log-sum-exp lse (N, n); a query
// that sees no key gets o = 0 and lse = kEmpty. Backward takes do and dlse (the gradient of
// lse, so that parts of a pattern computed separately can be merged exactly) and returns
// dq, dk, dv.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int T = 16;               // Query and key tile length.
constexpr float kMasked = -1e30f;   // Logit of a pair the pattern does not allow.
constexpr float kEmpty = -1e30f;    // lse of a query that sees no key (matches NEG_INF).

// exp(x) for x <= 0 to about 2 ulp, written so that the compiler vectorizes loops over it:
// x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n through the exponent bits.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.0f ? 0.0f : p * scale;
}

struct Layout {
  const int32_t* row_ptr;
  const int32_t* col;
  const int32_t* mask_id;
  const uint8_t* masks;
};

// Runs fn(i) for i in [0, count) on up to `threads` threads.
template <typename Fn>
void ParallelFor(int64_t count, int64_t threads, Fn fn) {
  threads = std::max<int64_t>(1, std::min(threads, count));
  if (threads == 1) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// st[r][c] = a[r] . bt[:, c] for a (T, D) row-major and bt (D, T): a tile of products with
// one operand tile-transposed, so that the inner loop runs over 16 contiguous floats.
template <int D>
inline void TileProducts(const float* a, const float* bt, float st[T][T]) {
  for (int r = 0; r < T; r += 4) {
    float s0[T] = {}, s1[T] = {}, s2[T] = {}, s3[T] = {};
    for (int d = 0; d < D; ++d) {
      const float* b = bt + d * T;
      const float a0 = a[r * D + d], a1 = a[(r + 1) * D + d];
      const float a2 = a[(r + 2) * D + d], a3 = a[(r + 3) * D + d];
      for (int c = 0; c < T; ++c) {
        s0[c] += a0 * b[c];
        s1[c] += a1 * b[c];
        s2[c] += a2 * b[c];
        s3[c] += a3 * b[c];
      }
    }
    for (int c = 0; c < T; ++c) {
      st[r][c] = s0[c];
      st[r + 1][c] = s1[c];
      st[r + 2][c] = s2[c];
      st[r + 3][c] = s3[c];
    }
  }
}

// at (D, T) = a (T, D) transposed.
template <int D>
inline void Transpose(const float* a, float at[D][T]) {
  for (int r = 0; r < T; ++r) {
    for (int d = 0; d < D; ++d) at[d][r] = a[r * D + d];
  }
}

// out[r] += sum_c w[r][c] a[c], rows of D floats: each output row stays in registers.
template <int D>
inline void MulAdd(const float w[T][T], const float* a, float* out) {
  for (int r = 0; r < T; ++r) {
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = out[r * D + d];
    for (int c = 0; c < T; ++c) {
      const float x = w[r][c];
      for (int d = 0; d < D; ++d) acc[d] += x * a[c * D + d];
    }
    for (int d = 0; d < D; ++d) out[r * D + d] = acc[d];
  }
}

// out[c] = scale[c] out[c] + sum_r w[r][c] a[r] (scale may be null = 1).
template <int D>
inline void MulAddT(const float w[T][T], const float* a, const float* scale, float* out) {
  for (int c = 0; c < T; ++c) {
    float acc[D];
    const float f = scale == nullptr ? 1.0f : scale[c];
    for (int d = 0; d < D; ++d) acc[d] = f * out[c * D + d];
    for (int r = 0; r < T; ++r) {
      const float x = w[r][c];
      for (int d = 0; d < D; ++d) acc[d] += x * a[r * D + d];
    }
    for (int d = 0; d < D; ++d) out[c * D + d] = acc[d];
  }
}

// Masks a transposed score tile st[key][query]: other documents, and the pattern's mask
// (stored key-major too) if the tile has one. Returns through st; masked -> kMasked.
inline void ApplyMask(const int32_t* seg_q, const int32_t* seg_k, const uint8_t* mask,
                      float st[T][T]) {
  if (mask == nullptr) {
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) st[j][i] = seg_q[i] == seg_k[j] ? st[j][i] : kMasked;
    }
  } else {
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) {
        st[j][i] = (seg_q[i] == seg_k[j]) & (mask[j * T + i] != 0) ? st[j][i] : kMasked;
      }
    }
  }
}

inline const uint8_t* TileMask(const Layout& lay, int32_t e) {
  return lay.mask_id[e] < 0 ? nullptr : lay.masks + int64_t{lay.mask_id[e]} * T * T;
}

// Forward of query tile t of one item: online softmax over the layout's key tiles. Scores
// are computed key-major (st[j][i] = k_j . q_i) so the softmax statistics of the 16 queries
// are vector lanes.
template <int D>
void ForwardTile(const float* q, const float* k, const float* v, const int32_t* seg,
                 const Layout& lay, int64_t t, float* o, float* lse) {
  alignas(64) float qt[D][T];
  Transpose<D>(q + t * T * D, qt);
  float* acc = o + t * T * D;  // Accumulates in place in the output tile.
  std::memset(acc, 0, sizeof(float) * T * D);
  alignas(64) float m[T], l[T];
  for (int i = 0; i < T; ++i) m[i] = kMasked, l[i] = 0.0f;
  const int32_t* seg_q = seg + t * T;
  for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
    const int64_t u = lay.col[e];
    alignas(64) float st[T][T];
    TileProducts<D>(k + u * T * D, &qt[0][0], st);
    ApplyMask(seg_q, seg + u * T, TileMask(lay, e), st);
    alignas(64) float m_new[T], corr[T], sum[T];
    for (int i = 0; i < T; ++i) m_new[i] = m[i];
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) m_new[i] = st[j][i] > m_new[i] ? st[j][i] : m_new[i];
    }
    for (int i = 0; i < T; ++i) corr[i] = exp_nonpositive(m[i] - m_new[i]), sum[i] = 0.0f;
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) {
        const float p = st[j][i] > 0.5f * kMasked ? exp_nonpositive(st[j][i] - m_new[i]) : 0.0f;
        st[j][i] = p;
        sum[i] += p;
      }
    }
    for (int i = 0; i < T; ++i) l[i] = l[i] * corr[i] + sum[i], m[i] = m_new[i];
    MulAddT<D>(st, v + u * T * D, corr, acc);
  }
  for (int i = 0; i < T; ++i) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int d = 0; d < D; ++d) acc[i * D + d] *= inv;
    lse[t * T + i] = l[i] > 0.0f ? m[i] + std::log(l[i]) : kEmpty;
  }
}

// Backward of one item, query tile by query tile; dk and dv accumulate over query tiles.
template <int D>
void BackwardItem(const float* q, const float* k, const float* v, const int32_t* seg,
                  const float* o, const float* lse, const float* dout, const float* dlse,
                  const Layout& lay, int64_t n_tiles, float* dq, float* dk, float* dv) {
  std::memset(dk, 0, sizeof(float) * n_tiles * T * D);
  std::memset(dv, 0, sizeof(float) * n_tiles * T * D);
  for (int64_t t = 0; t < n_tiles; ++t) {
    const float* q_tile = q + t * T * D;
    const float* do_tile = dout + t * T * D;
    alignas(64) float qt[D][T], dot[D][T];
    Transpose<D>(q_tile, qt);
    Transpose<D>(do_tile, dot);
    alignas(64) float delta[T], row_lse[T];
    for (int i = 0; i < T; ++i) {
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc += do_tile[i * D + d] * o[(t * T + i) * D + d];
      delta[i] = acc - dlse[t * T + i];  // dS = P (dP - delta + dlse)
      // A query that sees no key has P = 0: an lse above every logit makes every exp 0.
      row_lse[i] = lse[t * T + i] > 0.5f * kEmpty ? lse[t * T + i] : -kMasked;
    }
    float* dq_tile = dq + t * T * D;
    std::memset(dq_tile, 0, sizeof(float) * T * D);
    const int32_t* seg_q = seg + t * T;
    for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
      const int64_t u = lay.col[e];
      alignas(64) float pt[T][T], dst[T][T];
      TileProducts<D>(k + u * T * D, &qt[0][0], pt);
      ApplyMask(seg_q, seg + u * T, TileMask(lay, e), pt);
      for (int j = 0; j < T; ++j) {
        for (int i = 0; i < T; ++i) {
          pt[j][i] = exp_nonpositive(std::min(pt[j][i] - row_lse[i], 0.0f));
        }
      }
      MulAdd<D>(pt, do_tile, dv + u * T * D);  // dV_u += P^T dO
      TileProducts<D>(v + u * T * D, &dot[0][0], dst);  // dP^T = V_u dO^T
      for (int j = 0; j < T; ++j) {
        for (int i = 0; i < T; ++i) dst[j][i] = pt[j][i] * (dst[j][i] - delta[i]);  // dS^T
      }
      MulAddT<D>(dst, k + u * T * D, nullptr, dq_tile);  // dQ += dS K_u
      MulAdd<D>(dst, q_tile, dk + u * T * D);  // dK_u += dS^T Q
    }
  }
}

template <typename Dims>
ffi::Error CheckLayout(int64_t n, const Dims& row_ptr) {
  if (n % T != 0) return ffi::Error::InvalidArgument("sequence length must be a multiple of 16");
  if (row_ptr.size() != 1 || row_ptr[0] != n / T + 1) {
    return ffi::Error::InvalidArgument("row_ptr must have n / 16 + 1 entries");
  }
  return ffi::Error::Success();
}

template <int D>
void Forward(int64_t items, int64_t n, int64_t threads, const float* q, const float* k,
             const float* v, const int32_t* seg, const Layout& lay, float* o, float* lse) {
  const int64_t n_tiles = n / T;
  ParallelFor(items * n_tiles, threads, [&](int64_t w) {
    const int64_t b = w / n_tiles, t = w % n_tiles;
    ForwardTile<D>(q + b * n * D, k + b * n * D, v + b * n * D, seg + b * n, lay, t,
                   o + b * n * D, lse + b * n);
  });
}

template <int D>
void Backward(int64_t items, int64_t n, int64_t threads, const float* q, const float* k,
              const float* v, const int32_t* seg, const float* o,
              const float* lse, const float* dout, const float* dlse, const Layout& lay,
              float* dq, float* dk, float* dv) {
  ParallelFor(items, threads, [&](int64_t b) {
    const int64_t x = b * n * D;
    BackwardItem<D>(q + x, k + x, v + x, seg + b * n, o + x, lse + b * n, dout + x,
                    dlse + b * n, lay, n / T, dq + x, dk + x, dv + x);
  });
}

// Calls fn.template operator()<D>() for the supported head widths.
template <typename Fn>
ffi::Error DispatchHeadDim(int64_t d, Fn fn) {
  switch (d) {
    case 16: fn.template operator()<16>(); break;
    case 32: fn.template operator()<32>(); break;
    case 64: fn.template operator()<64>(); break;
    case 128: fn.template operator()<128>(); break;
    case 256: fn.template operator()<256>(); break;
    default: return ffi::Error::InvalidArgument("head_dim must be 16, 32, 64, 128 or 256");
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg,
                       ffi::Buffer<ffi::S32> row_ptr, ffi::Buffer<ffi::S32> col,
                       ffi::Buffer<ffi::S32> mask_id, ffi::Buffer<ffi::U8> masks,
                       int64_t threads, ffi::ResultBuffer<ffi::F32> o,
                       ffi::ResultBuffer<ffi::F32> lse) {
  const auto dims = q.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("q must be (items, n, head_dim)");
  const int64_t items = dims[0], n = dims[1], d = dims[2];
  if (ffi::Error err = CheckLayout(n, row_ptr.dimensions()); err.failure()) return err;
  const Layout lay{row_ptr.typed_data(), col.typed_data(), mask_id.typed_data(),
                   masks.typed_data()};
  return DispatchHeadDim(d, [&]<int D>() {
    Forward<D>(items, n, threads, q.typed_data(), k.typed_data(), v.typed_data(),
               seg.typed_data(), lay, o->typed_data(), lse->typed_data());
  });
}

ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg,
                        ffi::Buffer<ffi::F32> o,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                        ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> row_ptr,
                        ffi::Buffer<ffi::S32> col, ffi::Buffer<ffi::S32> mask_id,
                        ffi::Buffer<ffi::U8> masks, int64_t threads,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv) {
  const auto dims = q.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("q must be (items, n, head_dim)");
  const int64_t items = dims[0], n = dims[1], d = dims[2];
  if (ffi::Error err = CheckLayout(n, row_ptr.dimensions()); err.failure()) return err;
  const Layout lay{row_ptr.typed_data(), col.typed_data(), mask_id.typed_data(),
                   masks.typed_data()};
  return DispatchHeadDim(d, [&]<int D>() {
    Backward<D>(items, n, threads, q.typed_data(), k.typed_data(), v.typed_data(),
                seg.typed_data(), o.typed_data(), lse.typed_data(),
                dout.typed_data(), dlse.typed_data(), lay, dq->typed_data(), dk->typed_data(),
                dv->typed_data());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooBlockSparseForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_ptr
                                  .Arg<ffi::Buffer<ffi::S32>>()  // col
                                  .Arg<ffi::Buffer<ffi::S32>>()  // mask_id
                                  .Arg<ffi::Buffer<ffi::U8>>()   // masks
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooBlockSparseBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dlse
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_ptr
                                  .Arg<ffi::Buffer<ffi::S32>>()  // col
                                  .Arg<ffi::Buffer<ffi::S32>>()  // mask_id
                                  .Arg<ffi::Buffer<ffi::U8>>()   // masks
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
