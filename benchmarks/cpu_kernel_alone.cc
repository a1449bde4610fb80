// The CPU kernel timed alone, without XLA around it (see cpu_kernel_alone.py, which builds
// and runs this): forward and backward of one layer on a causal sliding window of w keys
// (w = 0: dense causal), `items` heads of 64, n positions, identity order, one document.
//
//   cpu_kernel_alone N ITEMS W THREADS ITERS
// prints: fwd_ms bwd_ms computed_pairs (best of ITERS).

#include "../models/attention/kernels/blocksparse_cpu.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace {

struct OwnedLayout {
  std::vector<int32_t> row_ptr{0}, col, mask_id;
  std::vector<uint8_t> masks;
};

// The same layout cpu_kernel.tile_layout builds for patterns.Local(w) / Dense().
OwnedLayout WindowLayout(int64_t n, int64_t w) {
  OwnedLayout out;
  std::vector<std::vector<uint8_t>> distinct;
  for (int64_t t = 0; t < n / T; ++t) {
    for (int64_t u = 0; u <= t; ++u) {
      std::vector<uint8_t> mask(T * T);
      int allowed = 0;
      for (int j = 0; j < T; ++j) {
        for (int i = 0; i < T; ++i) {
          const int64_t qi = t * T + i, kj = u * T + j;
          mask[j * T + i] = kj <= qi && (w == 0 || qi - kj < w);
          allowed += mask[j * T + i];
        }
      }
      if (allowed == 0) continue;
      out.col.push_back(u);
      if (allowed == T * T) {
        out.mask_id.push_back(-1);
        continue;
      }
      int id = 0;
      while (id < static_cast<int>(distinct.size()) && distinct[id] != mask) ++id;
      if (id == static_cast<int>(distinct.size())) distinct.push_back(mask);
      out.mask_id.push_back(id);
    }
    out.row_ptr.push_back(out.col.size());
  }
  for (const auto& m : distinct) out.masks.insert(out.masks.end(), m.begin(), m.end());
  out.masks.resize(std::max<size_t>(out.masks.size(), T * T));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s N ITEMS W THREADS ITERS\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atol(argv[1]), items = std::atol(argv[2]), w = std::atol(argv[3]);
  const int64_t threads = std::atol(argv[4]), iters = std::atol(argv[5]);
  constexpr int D = 64;
  if (n % T != 0) {
    std::fprintf(stderr, "N must be a multiple of %d\n", T);
    return 2;
  }
  const OwnedLayout owned = WindowLayout(n, w);
  const Layout lay{owned.row_ptr.data(), owned.col.data(), owned.mask_id.data(),
                   owned.masks.data()};
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(items * n * D), k(q.size()), v(q.size()), dout(q.size());
  for (auto* a : {&q, &k, &v, &dout}) {
    for (float& x : *a) x = normal(rng);
  }
  for (float& x : q) x *= 0.125f;  // The logit scale 1 / sqrt(64).
  std::vector<float> o(q.size()), dq(q.size()), dk(q.size()), dv(q.size());
  std::vector<float> lse(items * n), dlse(items * n, 0.0f);
  std::vector<int32_t> seg(items * n, 1), order(n);
  for (int64_t p = 0; p < n; ++p) order[p] = p;
  const Shape s{items, n, 1, D};
  const int64_t n_tiles = n / T;
  double best_fwd = 1e30, best_bwd = 1e30;
  for (int64_t it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    ParallelFor(items * n_tiles, threads, [&](int64_t work) {
      const Item x = MakeItem(s, work / n_tiles, 0, order.data(), q.data(), k.data(), v.data(),
                              nullptr, nullptr, o.data(), nullptr, nullptr, nullptr,
                              seg.data(), lse.data(), nullptr, nullptr);
      alignas(64) float sink[T * D];
      ForwardTile<D>(x, lay, work % n_tiles, sink);
    });
    const auto t1 = std::chrono::steady_clock::now();
    ParallelFor(items, threads, [&](int64_t item) {
      const Item x = MakeItem(s, item, 0, order.data(), q.data(), k.data(), v.data(), o.data(),
                              dout.data(), nullptr, dq.data(), dk.data(), dv.data(),
                              seg.data(), nullptr, lse.data(), dlse.data());
      std::vector<float> sink(T * D);
      BackwardItem<D>(x, lay, sink.data());
    });
    const auto t2 = std::chrono::steady_clock::now();
    best_fwd = std::min(best_fwd, std::chrono::duration<double, std::milli>(t1 - t0).count());
    best_bwd = std::min(best_bwd, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  std::printf("%.3f %.3f %lld\n", best_fwd, best_bwd,
              static_cast<long long>(owned.col.size() * T * T * items));
  return 0;
}
