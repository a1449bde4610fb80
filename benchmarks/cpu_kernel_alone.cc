// The CPU kernel timed alone, without XLA around it (see cpu_kernel_alone.py, which builds
// and runs this): forward and backward of one layer, `items` heads of 64, n positions,
// identity order, one document, on the tile layout cpu_kernel.tile_layout wrote to DIR as
// raw arrays (row_ptr.i32, col.i32, mask_id.i32, masks.u8).
//
//   cpu_kernel_alone N ITEMS DIR THREADS ITERS
// prints: fwd_ms bwd_ms computed_pairs (best of ITERS).

#include "../models/attention/kernels/blocksparse_cpu.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

namespace {

template <typename X>
std::vector<X> ReadArray(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> raw((std::istreambuf_iterator<char>(f)),
                              std::istreambuf_iterator<char>());
  std::vector<X> out(raw.size() / sizeof(X));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(X));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s N ITEMS DIR THREADS ITERS\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atol(argv[1]), items = std::atol(argv[2]);
  const std::string dir = argv[3];
  const int64_t threads = std::atol(argv[4]), iters = std::atol(argv[5]);
  constexpr int D = 64;
  const auto row_ptr = ReadArray<int32_t>(dir + "/row_ptr.i32");
  const auto col = ReadArray<int32_t>(dir + "/col.i32");
  const auto mask_id = ReadArray<int32_t>(dir + "/mask_id.i32");
  const auto masks = ReadArray<uint8_t>(dir + "/masks.u8");
  if (n % T != 0 || static_cast<int64_t>(row_ptr.size()) != n / T + 1) {
    std::fprintf(stderr, "N must be a multiple of %d matching the layout in %s\n", T,
                 dir.c_str());
    return 2;
  }
  const Layout lay{row_ptr.data(), col.data(), mask_id.data(), masks.data()};
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
              static_cast<long long>(col.size() * T * T * items));
  return 0;
}
