// Block-sparse softmax attention on the CPU: a fused tile kernel called through the XLA FFI.
//
// XLA:CPU runs the small batched matmuls of a thin pattern (16-64 rows) at a fraction of its
// large-matmul speed and writes every score tile to memory between ops. This kernel walks a
// static tile layout (for each 16-query tile, the 16-key tiles the pattern touches, each
// either fully allowed or with a 16 x 16 mask) and keeps scores, probabilities and the running
// softmax statistics in registers / L1, as flash attention does on GPUs. Work and memory
// follow the layout's tiles, so they grow with the pattern, not with n^2.
//
// Operands (B batch rows, H heads, n positions, D head width, P parts):
//   q, k, v (B, n, H, D)  as the model holds them (no transposes); each (b, h) is one
//                         independent item; the logits are scale * q . k (attribute `scale`);
//   seg (B, n) int32      document ids: query i sees key j only if seg[i] == seg[j];
//   order (P, n) int32    each part's computation order: tile position p is sequence position
//                         order[p] (the identity, or positions sorted by residue mod l so
//                         that a strided part becomes block-diagonal); positions p >= n of
//                         the last tile are padding, never allowed;
//   row_ptr (P, n/16 + 1), col (E), mask_id (E), masks (M, 16 keys, 16 queries) uint8: the
//   key tiles of query tile t of part p are col[row_ptr[p][t] .. row_ptr[p][t + 1]) (indexes
//   into the concatenation of all parts' tiles); mask_id -1 = every pair of the tile allowed.
// The parts are disjoint sets of pairs; the kernel computes softmax attention over their
// union: the forward runs part after part, merging each into the output by log-sum-exps;
// the backward, which only needs the final lse, adds each part's terms.
// Forward returns the normalized output o (B, n, H, D) and the log-sum-exp lse (B, n, H); a
// query that sees no key gets o = 0 and lse = kEmpty. Backward takes do and dlse (the
// gradient of lse) and returns dq, dk, dv.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using zoo_cpu::exp_nonpositive;
using zoo_cpu::FlushDenormals;
using zoo_cpu::Helpers;
using zoo_cpu::ParallelFor;
using zoo_cpu::Store;

constexpr int T = 16;               // Query and key tile length.
constexpr float kMasked = -1e30f;   // Logit of a pair the pattern does not allow.
constexpr float kEmpty = -1e30f;    // lse of a query that sees no key (matches NEG_INF).

// log(x) for normal x > 0 to about 2 ulp, vectorizable like exp_nonpositive: x = 2^e m with
// m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) = 2 (s + s^3/3 + ... + s^9/9), s = (m-1)/(m+1).
inline float log_positive(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = ((bits >> 23) & 0xff) - 127;
  bits = (bits & 0x007fffff) | 0x3f800000;
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool high = m > 1.41421356f;
  m = high ? 0.5f * m : m;
  e = high ? e + 1 : e;
  const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  float p = 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return static_cast<float>(e) * 0.693147180559945f + 2.0f * s * p;
}

struct Layout {
  const int32_t* row_ptr;
  const int32_t* col;
  const int32_t* mask_id;
  const uint8_t* masks;
};

// Eight floats in one SIMD register (GCC/Clang vector extension: AVX on x86, two NEON
// registers on Arm). The hot loops below keep their accumulators in such registers
// explicitly; left to itself the compiler spilled them to the stack.
typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) { return zoo_cpu::LoadVector<v8>(p); }

inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

alignas(64) const float kZeroRow[256] = {};  // Row of a padding position (D <= 256).

// One item's rows of one operand: tile position p is row base + order[p] * stride.
template <typename F>
struct Rows {
  F* base;
  int64_t stride;
  const int32_t* order;
  int64_t n;

  // The 16 rows of tile t; padding positions read zeros (and write to `sink`).
  void Tile(int64_t t, F* rows[T], F* sink) const {
    for (int r = 0; r < T; ++r) {
      const int64_t p = t * T + r;
      rows[r] = p < n ? base + order[p] * stride : sink;
    }
  }
};

// Rows r..r+3 of TileProducts, over the columns of bt's halves Lo (0..7) and Hi (8..15); a
// half not computed is written as zeros.
template <int D, bool Lo, bool Hi>
inline void ProductRows4(const float* const a[T], const float* bt, float st[T][T], int r) {
  v8 c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {};
  const float *a0 = a[r], *a1 = a[r + 1], *a2 = a[r + 2], *a3 = a[r + 3];
  for (int d = 0; d < D; ++d) {
    const v8 x0 = Splat(a0[d]), x1 = Splat(a1[d]), x2 = Splat(a2[d]), x3 = Splat(a3[d]);
    if (Lo) {
      const v8 b0 = Load(bt + d * T);
      c00 += x0 * b0, c10 += x1 * b0, c20 += x2 * b0, c30 += x3 * b0;
    }
    if (Hi) {
      const v8 b1 = Load(bt + d * T + 8);
      c01 += x0 * b1, c11 += x1 * b1, c21 += x2 * b1, c31 += x3 * b1;
    }
  }
  Store(st[r], c00), Store(st[r] + 8, c01), Store(st[r + 1], c10), Store(st[r + 1] + 8, c11);
  Store(st[r + 2], c20), Store(st[r + 2] + 8, c21), Store(st[r + 3], c30);
  Store(st[r + 3] + 8, c31);
}

// st[r][c] = a[r] . bt[:, c] for rows a[r] of D floats and bt (D, T): a tile of products with
// one operand tile-transposed, so that each step is a broadcast times 16 contiguous floats.
// `halves`, if given, says for each group of 4 rows which halves of the columns (bit 0:
// 0..7, bit 1: 8..15) any of them uses; a half none uses is skipped (written as zeros). On
// the partial tiles of causal and banded patterns that is a quarter of the products.
template <int D>
inline void TileProducts(const float* const a[T], const float* bt, float st[T][T],
                         const uint8_t* halves = nullptr) {
  for (int r = 0; r < T; r += 4) {
    const bool lo = halves == nullptr || (halves[r / 4] & 1);
    const bool hi = halves == nullptr || (halves[r / 4] & 2);
    if (lo && hi) {
      ProductRows4<D, true, true>(a, bt, st, r);
    } else if (lo) {
      ProductRows4<D, true, false>(a, bt, st, r);
    } else if (hi) {
      ProductRows4<D, false, true>(a, bt, st, r);
    } else {
      ProductRows4<D, false, false>(a, bt, st, r);
    }
  }
}

// at (D, T) = scale times the rows a[r] transposed: in 8 x 8 blocks in registers where AVX
// is there. Written element by element, the compiler made 64 scalar stores of each row, a
// tenth of a thin pattern's forward.
template <int D>
inline void Transpose(const float* const a[T], float at[D][T], float scale = 1.0f) {
#if defined(__AVX__)
  const __m256 s = _mm256_set1_ps(scale);
  for (int r0 = 0; r0 < T; r0 += 8) {
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 x[8], y[8];
      for (int i = 0; i < 8; ++i) x[i] = _mm256_mul_ps(s, _mm256_loadu_ps(a[r0 + i] + d0));
      for (int i = 0; i < 8; i += 2) {  // Pairs of rows interleaved.
        y[i] = _mm256_unpacklo_ps(x[i], x[i + 1]), y[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {  // Quads of rows: each 128-bit lane holds a column.
        x[i] = _mm256_shuffle_ps(y[i], y[i + 2], 0x44);
        x[i + 1] = _mm256_shuffle_ps(y[i], y[i + 2], 0xee);
        x[i + 2] = _mm256_shuffle_ps(y[i + 1], y[i + 3], 0x44);
        x[i + 3] = _mm256_shuffle_ps(y[i + 1], y[i + 3], 0xee);
      }
      for (int j = 0; j < 4; ++j) {  // Columns j and j + 4 from the two quads' lanes.
        _mm256_store_ps(&at[d0 + j][r0], _mm256_permute2f128_ps(x[j], x[j + 4], 0x20));
        _mm256_store_ps(&at[d0 + j + 4][r0], _mm256_permute2f128_ps(x[j], x[j + 4], 0x31));
      }
    }
  }
#else
  for (int r = 0; r < T; ++r) {
    for (int d = 0; d < D; ++d) at[d][r] = scale * a[r][d];
  }
#endif
}

// Copies the rows a[r] into the contiguous tile c and points a[r] at its rows.
template <int D>
inline void Gather(const float* a[T], float c[T][D]) {
  for (int r = 0; r < T; ++r) std::memcpy(c[r], a[r], sizeof(float) * D), a[r] = c[r];
}

constexpr int Chunk(int d) { return d < 64 ? d : 64; }  // Floats of a row kept in registers.

// The rows [lo, hi) of one operand that a row of the other meets in a tile's mask.
struct Span {
  int8_t lo, hi;
};

// For each 16 x 16 mask: the keys each query may see, and the queries each key may be seen
// by. The products over a masked tile skip the rest, whose terms are zero: on the diagonal
// tiles of causal and banded patterns, about half of the work.
struct MaskSpans {
  Span by_query[T], by_key[T];
  uint8_t key_halves[T / 4];  // Per 4 keys: bit 0 if one sees a query of 0..7, bit 1 of 8..15.
};

std::vector<MaskSpans> ComputeSpans(const uint8_t* masks, int64_t count) {
  std::vector<MaskSpans> out(count);
  for (int64_t id = 0; id < count; ++id) {
    MaskSpans& s = out[id];
    for (int r = 0; r < T; ++r) s.by_query[r] = s.by_key[r] = Span{T, 0};
    for (int g = 0; g < T / 4; ++g) s.key_halves[g] = 0;
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) {
        if (masks[(id * T + j) * T + i] == 0) continue;  // Key j, query i.
        s.key_halves[j / 4] |= i < 8 ? 1 : 2;
        Span &q = s.by_query[i], &k = s.by_key[j];
        q.lo = std::min<int8_t>(q.lo, j), q.hi = std::max<int8_t>(q.hi, j + 1);
        k.lo = std::min<int8_t>(k.lo, i), k.hi = std::max<int8_t>(k.hi, i + 1);
      }
    }
  }
  return out;
}

// out[r] = f[r] out[r] + sum_c w(r, c) a[c] over rows of D floats, w(r, c) = w[r][c] or, if
// Transposed, w[c][r]; f may be null (= 1). Rows r with bit r of `fresh` set are written
// without being read (out[r] = sum ...). `span`, if given, promises w(r, c) = 0 for c
// outside span[r]: those terms are skipped. Each output row chunk stays in registers.
template <int D, bool Transposed>
inline void MulAddRows(const float w[T][T], const float* const a[T], const float* f,
                       float* const out[T], uint32_t fresh = 0, const Span* span = nullptr) {
  constexpr int kC = Chunk(D), kV = kC / 8;
  for (int r = 0; r < T; ++r) {
    const v8 scale = Splat(f == nullptr ? 1.0f : f[r]);
    const bool read = !(fresh >> r & 1);
    const int c0 = span == nullptr ? 0 : span[r].lo, c1 = span == nullptr ? T : span[r].hi;
    for (int d0 = 0; d0 < D; d0 += kC) {
      v8 acc[kV];
      for (int x = 0; x < kV; ++x) acc[x] = read ? scale * Load(out[r] + d0 + 8 * x) : v8{};
      for (int c = c0; c < c1; ++c) {
        const v8 wv = Splat(Transposed ? w[c][r] : w[r][c]);
        const float* ac = a[c] + d0;
        for (int x = 0; x < kV; ++x) acc[x] += wv * Load(ac + 8 * x);
      }
      for (int x = 0; x < kV; ++x) Store(out[r] + d0 + 8 * x, acc[x]);
    }
  }
}

// Masks a transposed score tile st[key][query]: other documents, and the pattern's mask
// (stored key-major too) if the tile has one; masked -> kMasked.
// Always inlined: GCC's inliner budgets grow with the translation unit, so this file alone
// (the kernel library) left it a call in the forward and the same code inside
// benchmarks/cpu_kernel_alone.cc inlined it. The library's forward then ran 1.3-1.5x slower
// end to end (dense's at 8K: 400 against 270 ms) and the harness timed other code than the
// model runs. With it inlined, both build the same hot functions.
[[gnu::always_inline]] inline void ApplyMask(const int32_t* seg_q, const int32_t* seg_k,
                                             const uint8_t* mask, float st[T][T]) {
  if (mask == nullptr) {
    int32_t other = 0;  // Nonzero if some query or key lies in another document.
    for (int i = 0; i < T; ++i) other |= (seg_q[i] ^ seg_q[0]) | (seg_k[i] ^ seg_q[0]);
    if (other == 0) return;
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

// The spans of tile entry e's mask (null: every pair of the tile allowed).
inline const MaskSpans* TileSpans(const Layout& lay, const MaskSpans* spans, int32_t e) {
  return lay.mask_id[e] < 0 ? nullptr : &spans[lay.mask_id[e]];
}

// Document ids of tile t in computation order (padding: -1, seen by nothing allowed).
inline void TileSegments(const int32_t* seg, const int32_t* order, int64_t n, int64_t t,
                         int32_t out[T]) {
  for (int r = 0; r < T; ++r) {
    const int64_t p = t * T + r;
    out[r] = p < n ? seg[order[p]] : -1;
  }
}

// One item (batch row b, head h) of all operands.
struct Item {
  Rows<const float> q, k, v, o_in, dout;
  Rows<float> o, dq, dk, dv;
  const int32_t* seg;   // (n) of batch row b
  float* lse;           // lse[order[p] * lse_stride]
  const float* lse_in;
  const float* dlse;
  int64_t lse_stride;
};

// The rows a query tile will touch first (its q, o or dO / o / dq rows, and the key tiles
// the tile before it did not use), asked for in slices while that tile before it computes:
// one slice per key tile, into L2 (prefetcht1 on x86). A thin pattern does little work per
// row it reads, and the hardware prefetcher did not run far enough ahead on one head's rows,
// H D floats apart: without it each new tile waited on memory. Timed alone at 8K
// (benchmarks/cpu_kernel_alone.py), forward + backward: strided 1.12x faster, local 1.08x,
// a one-tile window 1.2x. Asked for all at once, or into L1, the rows gained less: a burst
// of requests queues behind itself, and L1 holds only 8 lines per set.
// (An earlier version's prefetches were never emitted: GCC's pure-const analysis found the
// helper that issued them free of side effects and deleted its calls. Issue() changes the
// queue, and tests/models/test_cpu_kernel.py checks that the library holds prefetches.)
template <int D>
class Lookahead {
 public:
  // Queues query tile t of `it`: its own rows, and the key tiles in its row of the layout
  // after key tile `after` (the last one the tile before it used, as a row's key tiles are in
  // ascending order; -1 for all), at most kNewTiles of them.
  void Queue(const Item& it, const Layout& lay, int64_t t, bool backward, bool reads_dq,
             int64_t after) {
    Clear();
    Add(it.q, t);
    if (backward) {
      Add(it.dout, t), Add(it.o_in, t);
      if (reads_dq) Add(it.dq, t);
    } else {
      Add(it.o, t);
    }
    int tiles = 0;
    for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1] && tiles < kNewTiles; ++e) {
      const int64_t u = lay.col[e];
      if (u <= after) continue;
      ++tiles;
      Add(it.k, u), Add(it.v, u);
      if (backward) Add(it.dk, u), Add(it.dv, u);
    }
  }

  // The slice to issue per key tile of a query tile with `key_tiles` of them.
  int Slice(int64_t key_tiles) const {
    return key_tiles > 0 ? static_cast<int>((count_ + key_tiles - 1) / key_tiles) : count_;
  }

  // Asks for the 64-byte lines of the next `rows` queued rows, to be read, into L2
  // (locality 2: prefetcht1 on x86).
  void Issue(int rows) {
    for (const int end = std::min(count_, next_ + rows); next_ < end; ++next_) {
      for (int x = 0; x < D; x += 16) __builtin_prefetch(rows_[next_] + x, 0, 2);
    }
  }

  void IssueAll() { Issue(count_); }

  void Clear() { count_ = next_ = 0; }

 private:
  static constexpr int kNewTiles = 4;
  // A tile's rows of up to 4 query operands, and of 4 operands per new key tile.
  static constexpr int kMaxRows = (4 + 4 * kNewTiles) * T;

  template <typename F>
  void Add(const Rows<F>& rows, int64_t t) {
    for (int64_t p = t * T; p < std::min(t * T + T, rows.n); ++p) {
      rows_[count_++] = rows.base + rows.order[p] * rows.stride;
    }
  }

  const float* rows_[kMaxRows];
  int count_ = 0, next_ = 0;
};

// The last key tile query tile t of a layout uses (-1: none).
inline int64_t LastKeyTile(const Layout& lay, int64_t t) {
  return lay.row_ptr[t + 1] > lay.row_ptr[t] ? lay.col[lay.row_ptr[t + 1] - 1] : -1;
}

// Forward of query tile t of one item and one part: online softmax over the part's key
// tiles. Scores are computed key-major (st[j][i] = k_j . q_i) so the softmax statistics of
// the 16 queries are vector lanes. The first part writes o and lse; a later one (`merge`)
// combines its softmax with theirs. Issues `ahead` (the next tile's rows) as it goes.
template <int D>
void ForwardTile(const Item& it, const Layout& lay, int64_t t, float scale, bool merge,
                 bool gather, const MaskSpans* spans, float* sink, Lookahead<D>& ahead) {
  const int slice = ahead.Slice(lay.row_ptr[t + 1] - lay.row_ptr[t]);
  const float* q_rows[T];
  it.q.Tile(t, q_rows, kZeroRow);
  alignas(64) float qt[D][T];
  Transpose<D>(q_rows, qt, scale);
  alignas(64) float acc[T][D] = {};
  float* acc_rows[T];
  for (int i = 0; i < T; ++i) acc_rows[i] = acc[i];
  alignas(64) float m[T], l[T];
  for (int i = 0; i < T; ++i) m[i] = kMasked, l[i] = 0.0f;
  int32_t seg_q[T], seg_k[T];
  TileSegments(it.seg, it.q.order, it.q.n, t, seg_q);
  for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
    const int64_t u = lay.col[e];
    ahead.Issue(slice);
    const float *k_rows[T], *v_rows[T];
    it.k.Tile(u, k_rows, kZeroRow);
    it.v.Tile(u, v_rows, kZeroRow);
    alignas(64) float vc[T][D];
    if (gather) Gather<D>(v_rows, vc);
    TileSegments(it.seg, it.k.order, it.k.n, u, seg_k);
    const MaskSpans* sp = TileSpans(lay, spans, e);
    alignas(64) float st[T][T];
    TileProducts<D>(k_rows, &qt[0][0], st, sp ? sp->key_halves : nullptr);
    ApplyMask(seg_q, seg_k, TileMask(lay, e), st);
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
    // acc = corr acc + P V
    MulAddRows<D, true>(st, v_rows, corr, acc_rows, 0, sp ? sp->by_query : nullptr);
  }
  ahead.IssueAll();
  // The rows' statistics are computed for all 16 lanes at once (vectorized), then stored.
  alignas(64) float part_lse[T];
  for (int i = 0; i < T; ++i) part_lse[i] = l[i] > 0.0f ? m[i] + log_positive(l[i]) : kEmpty;
  float* o_rows[T];
  it.o.Tile(t, o_rows, sink);
  const int rows = static_cast<int>(std::min<int64_t>(T, it.q.n - t * T));
  float* lse_out[T];
  for (int i = 0; i < rows; ++i) lse_out[i] = it.lse + it.q.order[t * T + i] * it.lse_stride;
  if (!merge) {
    for (int i = 0; i < rows; ++i) {
      *lse_out[i] = part_lse[i];
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int d = 0; d < D; ++d) o_rows[i][d] = inv * acc[i][d];
    }
    return;
  }
  // Merging into the earlier parts' o and lse: lse' = log(e^lse + e^part_lse) and
  // o' = e^(lse - lse') o + e^(m - lse') acc (acc / l has log-sum-exp part_lse = m + log l).
  alignas(64) float old[T], new_lse[T], keep[T], add[T];
  for (int i = 0; i < T; ++i) old[i] = i < rows ? *lse_out[i] : kEmpty;
  for (int i = 0; i < T; ++i) {
    const float top = std::max(old[i], part_lse[i]);
    new_lse[i] = top + log_positive(exp_nonpositive(old[i] - top) +
                                    exp_nonpositive(part_lse[i] - top));
    keep[i] = exp_nonpositive(old[i] - new_lse[i]);
    add[i] = exp_nonpositive(m[i] - new_lse[i]);
  }
  for (int i = 0; i < rows; ++i) {
    if (l[i] == 0.0f) continue;  // This part lets query i see nothing: o and lse stay.
    *lse_out[i] = new_lse[i];
    for (int d = 0; d < D; ++d) o_rows[i][d] = keep[i] * o_rows[i][d] + add[i] * acc[i][d];
  }
}

// Backward of query tile t of one item and one part: adds the tile's terms to dk and dv
// (rows flagged in fresh[e] are written, not added to: see Backward) and writes dq
// (`add_dq`: adds, for parts after the first).
// P = exp(s - lse) with the final (merged) lse, and delta = rowsum(dO o) from the final o,
// hold for every part's pairs, so the parts need no merging here.
template <int D>
void BackwardTile(const Item& it, const Layout& lay, int64_t t, float scale, bool add_dq,
                  bool gather, const uint16_t* fresh, const MaskSpans* spans, float* sink,
                  Lookahead<D>& ahead) {
  const int slice = ahead.Slice(lay.row_ptr[t + 1] - lay.row_ptr[t]);
  const int64_t n = it.q.n;
  const float *q_rows[T], *do_rows[T], *o_rows[T];
  it.q.Tile(t, q_rows, kZeroRow);
  it.dout.Tile(t, do_rows, kZeroRow);
  it.o_in.Tile(t, o_rows, kZeroRow);
  alignas(64) float qc[T][D], doc[T][D];
  if (gather) Gather<D>(q_rows, qc), Gather<D>(do_rows, doc);
  alignas(64) float qt[D][T], dot[D][T];
  Transpose<D>(q_rows, qt, scale);
  Transpose<D>(do_rows, dot);
  alignas(64) float delta[T], row_lse[T];
  for (int i = 0; i < T; ++i) {
    const int64_t p = t * T + i;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += do_rows[i][d] * o_rows[i][d];
    const int64_t s = p < n ? it.q.order[p] * it.lse_stride : 0;
    const float lse = p < n ? it.lse_in[s] : kEmpty;
    delta[i] = acc - (p < n ? it.dlse[s] : 0.0f);  // dS = P (dP - delta + dlse)
    // A query that sees no key has P = 0: an lse above every logit makes every exp 0.
    row_lse[i] = lse > 0.5f * kEmpty ? lse : -kMasked;
  }
  alignas(64) float dq_acc[T][D] = {};
  float* dq_rows[T];
  for (int i = 0; i < T; ++i) dq_rows[i] = dq_acc[i];
  int32_t seg_q[T], seg_k[T];
  TileSegments(it.seg, it.q.order, n, t, seg_q);
  for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
    const int64_t u = lay.col[e];
    ahead.Issue(slice);
    const float *k_rows[T], *v_rows[T];
    float *dk_rows[T], *dv_rows[T];
    it.k.Tile(u, k_rows, kZeroRow);
    it.v.Tile(u, v_rows, kZeroRow);
    it.dk.Tile(u, dk_rows, sink);
    it.dv.Tile(u, dv_rows, sink);
    alignas(64) float kc[T][D];
    if (gather) Gather<D>(k_rows, kc);
    TileSegments(it.seg, it.k.order, n, u, seg_k);
    const MaskSpans* sp = TileSpans(lay, spans, e);
    const Span *by_query = sp ? sp->by_query : nullptr, *by_key = sp ? sp->by_key : nullptr;
    const uint8_t* halves = sp ? sp->key_halves : nullptr;
    alignas(64) float pt[T][T], dst[T][T];
    TileProducts<D>(k_rows, &qt[0][0], pt, halves);
    ApplyMask(seg_q, seg_k, TileMask(lay, e), pt);
    for (int j = 0; j < T; ++j) {
      for (int i = 0; i < T; ++i) {
        pt[j][i] = exp_nonpositive(std::min(pt[j][i] - row_lse[i], 0.0f));
      }
    }
    MulAddRows<D, false>(pt, do_rows, nullptr, dv_rows, fresh[e], by_key);  // dV_u += P^T dO
    TileProducts<D>(v_rows, &dot[0][0], dst, halves);  // dP^T = V_u dO^T
    for (int j = 0; j < T; ++j) {
      // dS^T, times the logit scale (s = scale q . k) for dQ and dK.
      for (int i = 0; i < T; ++i) dst[j][i] = scale * pt[j][i] * (dst[j][i] - delta[i]);
    }
    MulAddRows<D, true>(dst, k_rows, nullptr, dq_rows, 0, by_query);  // dQ += dS K_u
    MulAddRows<D, false>(dst, q_rows, nullptr, dk_rows, fresh[e], by_key);  // dK_u += dS^T Q
  }
  ahead.IssueAll();
  float* out_rows[T];
  it.dq.Tile(t, out_rows, sink);
  for (int i = 0; i < T; ++i) {
    if (add_dq) {
      for (int d = 0; d < D; ++d) out_rows[i][d] += dq_acc[i][d];
    } else {
      std::memcpy(out_rows[i], dq_acc[i], sizeof(float) * D);
    }
  }
}

// The operands of one call, as raw pointers (the FFI handlers below fill it, and so does
// benchmarks/cpu_kernel_alone.cc). Pointers a direction does not use are null.
struct Operands {
  int64_t batch, n, heads, d, parts;
  int64_t num_masks;               // 16 x 16 masks in layouts[*].masks (shared by the parts).
  const float *q, *k, *v;
  const int32_t* seg;              // (B, n)
  const int32_t* order;            // (P, n)
  std::vector<Layout> layouts;     // (P)
  const float *o_in, *lse_in, *dout, *dlse;  // Backward inputs.
  float *o, *lse;                  // Forward results.
  float *dq, *dk, *dv;             // Backward results.
  float scale;
  int64_t threads;
  ffi::ThreadPool* pool = nullptr;  // XLA's, inside a call; null: threads started per call.

  // Whether each part's order is other than the sequence's (residue order). Its tiles' rows
  // then lie l H D floats apart (128 KiB at l = 128 with 4 heads of 64): a multiple of the
  // 4 KiB period of the L1 cache's sets, so a tile's 16 rows compete for the same few sets.
  // The kernel copies the rows that the inner loops read 16 times (q and do per query
  // tile; the key tile's v forward, k backward) into contiguous tiles first: timed alone
  // at 8K, strided's residue part ran 1.2x faster.
  std::vector<bool> Scattered() const {
    std::vector<bool> out(parts, false);
    for (int64_t part = 0; part < parts; ++part) {
      for (int64_t p = 0; p < n && !out[part]; ++p) out[part] = order[part * n + p] != p;
    }
    return out;
  }

  // Item b h in part x's computation order.
  Item MakeItem(int64_t item, int64_t x) const {
    const int64_t b = item / heads, h = item % heads;
    const int64_t stride = heads * d, at = b * n * stride + h * d, y = b * n * heads + h;
    const int32_t* ord = order + x * n;
    auto in = [&](const float* a) { return Rows<const float>{a ? a + at : a, stride, ord, n}; };
    auto out = [&](float* a) { return Rows<float>{a ? a + at : a, stride, ord, n}; };
    auto row = [&](auto* a) { return a ? a + y : a; };
    return Item{in(q), in(k), in(v), in(o_in), in(dout), out(o), out(dq), out(dk), out(dv),
                seg + b * n, row(lse), row(lse_in), row(dlse), heads};
  }
};

// Both directions work in runs of kTilesPerTask query tiles (128 positions), taking the
// heads of a batch row one after the other within a run. The operands (B, n, H, D)
// interleave the heads, so a run reads one contiguous (128, H, D) block of each while it is
// in cache, rather than one head's rows, H D floats apart, over the whole sequence. Timed
// alone at 8K with 4 heads (benchmarks/cpu_kernel_alone.py), the forward of local / strided
// then costs what it costs on head-contiguous rows; the backward, which also updates dk and
// dv in place, pays up to about 1.2x. Transposing the heads in XLA around the call costs
// more than that.
constexpr int64_t kTilesPerTask = 8;

// Queues in `ahead` the tile that follows query tile t of `it` (head h of batch row b) in a
// task that runs tiles [t0, t1) of part `part` for heads [h, h_end) one after the other:
// the next tile of `it`, else the next head's first one, else nothing.
template <int D>
void QueueNextTile(Lookahead<D>& ahead, const Operands& x, const Item& it, int64_t part,
                   int64_t b, int64_t h, int64_t h_end, int64_t t, int64_t t0, int64_t t1,
                   bool backward) {
  const Layout& lay = x.layouts[part];
  const bool reads_dq = backward && part > 0;  // Later parts add to dq.
  if (t + 1 < t1) {
    ahead.Queue(it, lay, t + 1, backward, reads_dq, LastKeyTile(lay, t));
  } else if (h + 1 < h_end) {
    ahead.Queue(x.MakeItem(b * x.heads + h + 1, part), lay, t0, backward, reads_dq, -1);
  } else {
    ahead.Clear();
  }
}

template <int D>
void Forward(const Operands& x) {
  const int64_t n_tiles = (x.n + T - 1) / T;
  const int64_t tasks = (n_tiles + kTilesPerTask - 1) / kTilesPerTask;
  const std::vector<bool> scattered = x.Scattered();
  const std::vector<MaskSpans> spans = ComputeSpans(x.layouts[0].masks, x.num_masks);
  // Part after part (a later one merges into the output of the earlier ones); the query
  // tiles of one part are disjoint, so they run in parallel.
  Helpers helpers(x.pool);
  for (int64_t part = 0; part < x.parts; ++part) {
    ParallelFor(x.batch * tasks, x.threads, helpers, [&](int64_t w) {
      const int64_t b = w / tasks, t0 = (w % tasks) * kTilesPerTask;
      const int64_t t1 = std::min(t0 + kTilesPerTask, n_tiles);
      const Layout& lay = x.layouts[part];
      alignas(64) float sink[T * D];
      Lookahead<D> ahead;
      for (int64_t h = 0; h < x.heads; ++h) {
        const Item it = x.MakeItem(b * x.heads + h, part);
        for (int64_t t = t0; t < t1; ++t) {
          QueueNextTile(ahead, x, it, part, b, h, x.heads, t, t0, t1, /*backward=*/false);
          ForwardTile<D>(it, lay, t, x.scale, /*merge=*/part > 0, scattered[part], spans.data(),
                         sink, ahead);
        }
      }
    });
  }
}

// Query tiles per run in the backward's two-phase schedule (256 positions).
constexpr int64_t kBackwardRun = 16;

// dk and dv accumulate over query tiles, so two tasks running at once must never add to the
// same key tile. Where a part's key tiles lie near its query tiles (bands such as local
// attention and strided's A1 with w <= 256, block-local, residue parts), its query tiles run
// as runs of kBackwardRun tiles in two phases, the even runs in parallel and then the odd
// ones, each task one run of a batch row with its heads one after the other, as in the
// forward. TwoPhase checks that no two runs of one phase touch a key tile. Other parts (dense,
// fixed's summary columns) run one task per group of a batch row's heads, split into as many
// groups as keep the threads busy. Both orders are fixed by the layout, not by the thread
// count, so the gradients do not depend on it.
// With tasks per group of heads, a batch row with fewer heads than threads left threads
// idle, and a slower core could not hand work over (see Helpers: 57 against 47 ms); the runs
// of a phase are taken by whichever thread is free.
bool TwoPhase(const Layout& lay, int64_t n_tiles) {
  const int64_t runs = (n_tiles + kBackwardRun - 1) / kBackwardRun;
  if (runs < 2) return false;
  std::vector<int64_t> seen[2] = {std::vector<int64_t>(n_tiles, -1),
                                  std::vector<int64_t>(n_tiles, -1)};
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t run = t / kBackwardRun;
    std::vector<int64_t>& last = seen[run % 2];  // The run of this phase that last touched u.
    for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
      int64_t& r = last[lay.col[e]];
      if (r >= 0 && r != run) return false;
      r = run;
    }
  }
  return true;
}

// The query tiles of a part in the order the backward adds their terms: the even runs' tiles,
// then the odd runs', for a two-phase part; sequence order otherwise.
std::vector<int64_t> BackwardOrder(bool two_phase, int64_t n_tiles) {
  std::vector<int64_t> out;
  for (int64_t phase = 0; phase < (two_phase ? 2 : 1); ++phase) {
    for (int64_t t = 0; t < n_tiles; ++t) {
      if (!two_phase || (t / kBackwardRun) % 2 == phase) out.push_back(t);
    }
  }
  return out;
}

// dk and dv are not zeroed first: the first key tile entry, in the order the backward runs
// them (part, query tile in BackwardOrder, entry), to add to a row writes it. Zeroing them in
// a pass of their own and reading the zeros back made each new key tile's first update wait
// on memory: timed alone at 8K, that cost the backward of local attention (w = 128) about
// 1.2x and that of a window of one tile 1.4x.
template <int D>
void Backward(const Operands& x) {
  const int64_t n_tiles = (x.n + T - 1) / T;
  const std::vector<bool> scattered = x.Scattered();
  const std::vector<MaskSpans> spans = ComputeSpans(x.layouts[0].masks, x.num_masks);
  std::vector<bool> two_phase(x.parts);
  for (int64_t part = 0; part < x.parts; ++part) {
    two_phase[part] = TwoPhase(x.layouts[part], n_tiles);
  }
  // fresh[e] bit r: entry e is the first to add to row r of its key tile. Rows no entry
  // adds to are zeroed.
  const int64_t entries = x.layouts.back().row_ptr[n_tiles];
  std::vector<uint16_t> fresh(entries, 0);
  std::vector<uint8_t> touched(x.n, 0);
  for (int64_t part = 0; part < x.parts; ++part) {
    const Layout& lay = x.layouts[part];
    const int32_t* ord = x.order + part * x.n;
    for (int64_t t : BackwardOrder(two_phase[part], n_tiles)) {
      for (int32_t e = lay.row_ptr[t]; e < lay.row_ptr[t + 1]; ++e) {
        for (int r = 0; r < T; ++r) {
          const int64_t p = int64_t{lay.col[e]} * T + r;
          if (p < x.n && !touched[ord[p]]) touched[ord[p]] = 1, fresh[e] |= 1u << r;
        }
      }
    }
  }
  std::vector<int64_t> untouched;
  for (int64_t p = 0; p < x.n; ++p) {
    if (!touched[p]) untouched.push_back(p);
  }
  Helpers helpers(x.pool);
  if (!untouched.empty()) {
    ParallelFor(x.batch * x.heads, x.threads, helpers, [&](int64_t item) {
      const Item it = x.MakeItem(item, 0);
      for (int64_t p : untouched) {
        std::memset(it.dk.base + p * it.dk.stride, 0, sizeof(float) * D);
        std::memset(it.dv.base + p * it.dv.stride, 0, sizeof(float) * D);
      }
    });
  }
  // Query tiles [t0, t1) of batch row b, heads [h0, h1), in runs of kTilesPerTask tiles with
  // the heads one after the other within a run.
  auto tiles = [&](int64_t part, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1) {
    alignas(64) float sink[T * D];  // Writes of padding positions (always zero terms).
    const Layout& lay = x.layouts[part];
    const bool add_dq = part > 0;
    Lookahead<D> ahead;
    for (int64_t c0 = t0; c0 < t1; c0 += kTilesPerTask) {
      const int64_t c1 = std::min(c0 + kTilesPerTask, t1);
      for (int64_t h = h0; h < h1; ++h) {
        const Item it = x.MakeItem(b * x.heads + h, part);
        for (int64_t t = c0; t < c1; ++t) {
          QueueNextTile(ahead, x, it, part, b, h, h1, t, c0, c1, /*backward=*/true);
          BackwardTile<D>(it, lay, t, x.scale, add_dq, scattered[part], fresh.data(),
                          spans.data(), sink, ahead);
        }
      }
    }
  };
  for (int64_t part = 0; part < x.parts; ++part) {
    if (two_phase[part]) {
      const int64_t runs = (n_tiles + kBackwardRun - 1) / kBackwardRun;
      for (int64_t phase = 0; phase < 2; ++phase) {
        const int64_t count = (runs - phase + 1) / 2;  // Runs phase, phase + 2, ...
        ParallelFor(x.batch * count, x.threads, helpers, [&](int64_t w) {
          const int64_t b = w / count, run = phase + 2 * (w % count);
          const int64_t t0 = run * kBackwardRun;
          tiles(part, b, 0, x.heads, t0, std::min(t0 + kBackwardRun, n_tiles));
        });
      }
    } else {
      const int64_t groups = std::min(x.heads, std::max<int64_t>(1, x.threads / x.batch));
      const int64_t per_group = (x.heads + groups - 1) / groups;
      ParallelFor(x.batch * groups, x.threads, helpers, [&](int64_t w) {
        const int64_t b = w / groups, h0 = (w % groups) * per_group;
        tiles(part, b, h0, std::min(h0 + per_group, x.heads), 0, n_tiles);
      });
    }
  }
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

// Checks the shapes both directions share, q (B, n, H, D), seg (B, n), order (P, n),
// row_ptr (P, ceil(n / 16) + 1), and fills those fields of `x`.
ffi::Error Prepare(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
                   const ffi::Buffer<ffi::F32>& v, const ffi::Buffer<ffi::S32>& seg,
                   const ffi::Buffer<ffi::S32>& order, const ffi::Buffer<ffi::S32>& row_ptr,
                   const ffi::Buffer<ffi::S32>& col, const ffi::Buffer<ffi::S32>& mask_id,
                   const ffi::Buffer<ffi::U8>& masks, float scale, int64_t threads,
                   Operands* x) {
  const auto dims = q.dimensions();
  if (dims.size() != 4) return ffi::Error::InvalidArgument("q must be (batch, n, heads, head_dim)");
  const int64_t n = dims[1], rows = (n + T - 1) / T + 1;
  const auto seg_dims = seg.dimensions();
  if (seg_dims.size() != 2 || seg_dims[0] != dims[0] || seg_dims[1] != n) {
    return ffi::Error::InvalidArgument("segment ids must be (batch, n)");
  }
  const int64_t entries = static_cast<int64_t>(row_ptr.element_count()), parts = entries / rows;
  if (parts < 1 || entries != parts * rows) {
    return ffi::Error::InvalidArgument("row_ptr must be (parts, ceil(n / 16) + 1)");
  }
  if (static_cast<int64_t>(order.element_count()) != parts * n) {
    return ffi::Error::InvalidArgument("order must be (parts, n)");
  }
  *x = Operands{};
  x->batch = dims[0], x->n = n, x->heads = dims[2], x->d = dims[3], x->parts = parts;
  x->num_masks = static_cast<int64_t>(masks.element_count()) / (T * T);
  x->q = q.typed_data(), x->k = k.typed_data(), x->v = v.typed_data();
  x->seg = seg.typed_data(), x->order = order.typed_data();
  for (int64_t part = 0; part < parts; ++part) {
    x->layouts.push_back({row_ptr.typed_data() + part * rows, col.typed_data(),
                          mask_id.typed_data(), masks.typed_data()});
  }
  x->scale = scale, x->threads = threads;
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg,
                       ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> row_ptr,
                       ffi::Buffer<ffi::S32> col, ffi::Buffer<ffi::S32> mask_id,
                       ffi::Buffer<ffi::U8> masks, float scale, int64_t threads,
                       ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse,
                       ffi::ThreadPool pool) {
  Operands x;
  if (ffi::Error err = Prepare(q, k, v, seg, order, row_ptr, col, mask_id, masks, scale,
                               threads, &x);
      err.failure()) {
    return err;
  }
  x.o = o->typed_data(), x.lse = lse->typed_data();
  x.pool = &pool;
  return DispatchHeadDim(x.d, [&]<int D>() { Forward<D>(x); });
}

ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg,
                        ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> row_ptr,
                        ffi::Buffer<ffi::S32> col, ffi::Buffer<ffi::S32> mask_id,
                        ffi::Buffer<ffi::U8> masks, ffi::Buffer<ffi::F32> o,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                        ffi::Buffer<ffi::F32> dlse, float scale, int64_t threads,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, ffi::ThreadPool pool) {
  Operands x;
  if (ffi::Error err = Prepare(q, k, v, seg, order, row_ptr, col, mask_id, masks, scale,
                               threads, &x);
      err.failure()) {
    return err;
  }
  x.o_in = o.typed_data(), x.lse_in = lse.typed_data();
  x.dout = dout.typed_data(), x.dlse = dlse.typed_data();
  x.dq = dq->typed_data(), x.dk = dk->typed_data(), x.dv = dv->typed_data();
  x.pool = &pool;
  return DispatchHeadDim(x.d, [&]<int D>() { Backward<D>(x); });
}

// The operands both directions take first: q, k, v, seg, order and the tile layout.
auto BindOperands() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()   // q
      .Arg<ffi::Buffer<ffi::F32>>()   // k
      .Arg<ffi::Buffer<ffi::F32>>()   // v
      .Arg<ffi::Buffer<ffi::S32>>()   // seg
      .Arg<ffi::Buffer<ffi::S32>>()   // order (P, n)
      .Arg<ffi::Buffer<ffi::S32>>()   // row_ptr (P, n / 16 + 1)
      .Arg<ffi::Buffer<ffi::S32>>()   // col
      .Arg<ffi::Buffer<ffi::S32>>()   // mask_id
      .Arg<ffi::Buffer<ffi::U8>>();   // masks
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooBlockSparseForward, ForwardImpl,
                              BindOperands()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooBlockSparseBackward, BackwardImpl,
                              BindOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dlse
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ctx<ffi::ThreadPool>());
