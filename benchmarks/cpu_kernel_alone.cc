// The CPU kernel timed alone, without XLA around it (see cpu_kernel_alone.py, which builds
// and runs this): forward and backward of one layer, operands (BATCH, N, HEADS, 64) as
// the model holds them, one document, through the kernel's own Forward / Backward on the operands
// cpu_kernel.parts_layout wrote to DIR as raw arrays (order.i32, row_ptr.i32, col.i32,
// mask_id.i32, masks.u8).
//
//   cpu_kernel_alone N BATCH HEADS DIR THREADS ITERS
// prints: fwd_ms bwd_ms computed_pairs (best of ITERS).

#include "../models/attention/kernels/blocksparse_cpu.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <new>
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

// 64-byte aligned storage, as XLA gives its buffers (malloc's large blocks are only 16-byte
// aligned, so 256-byte rows would straddle an extra cache line).
template <typename X>
struct Aligned {
  using value_type = X;
  Aligned() = default;
  template <typename Y>
  Aligned(const Aligned<Y>&) {}
  X* allocate(size_t count) {
    return static_cast<X*>(::operator new(count * sizeof(X), std::align_val_t{64}));
  }
  void deallocate(X* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Aligned&) const { return true; }
};
using Floats = std::vector<float, Aligned<float>>;

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s N BATCH HEADS DIR THREADS ITERS\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atol(argv[1]), batch = std::atol(argv[2]), heads = std::atol(argv[3]);
  const int64_t items = batch * heads;
  const std::string dir = argv[4];
  const int64_t threads = std::atol(argv[5]), iters = std::atol(argv[6]);
  constexpr int D = 64;
  const auto order = ReadArray<int32_t>(dir + "/order.i32");
  const auto row_ptr = ReadArray<int32_t>(dir + "/row_ptr.i32");
  const auto col = ReadArray<int32_t>(dir + "/col.i32");
  const auto mask_id = ReadArray<int32_t>(dir + "/mask_id.i32");
  const auto masks = ReadArray<uint8_t>(dir + "/masks.u8");
  const int64_t rows = (n + T - 1) / T + 1, parts = static_cast<int64_t>(order.size()) / n;
  if (parts < 1 || static_cast<int64_t>(row_ptr.size()) != parts * rows) {
    std::fprintf(stderr, "N=%lld does not match the layout in %s\n", static_cast<long long>(n),
                 dir.c_str());
    return 2;
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  Floats q(items * n * D), k(q.size()), v(q.size()), dout(q.size());
  for (auto* a : {&q, &k, &v, &dout}) {
    for (float& x : *a) x = normal(rng);
  }
  Floats o(q.size()), dq(q.size()), dk(q.size()), dv(q.size());
  std::vector<float> lse(items * n), dlse(items * n, 0.0f);
  std::vector<int32_t> seg(items * n, 1);
  Operands x{};
  x.batch = batch, x.n = n, x.heads = heads, x.d = D, x.parts = parts;
  x.num_masks = static_cast<int64_t>(masks.size()) / (T * T);
  x.q = q.data(), x.k = k.data(), x.v = v.data(), x.seg = seg.data(), x.order = order.data();
  for (int64_t part = 0; part < parts; ++part) {
    x.layouts.push_back({row_ptr.data() + part * rows, col.data(), mask_id.data(), masks.data()});
  }
  x.o = o.data(), x.lse = lse.data();
  x.o_in = o.data(), x.lse_in = lse.data(), x.dout = dout.data(), x.dlse = dlse.data();
  x.dq = dq.data(), x.dk = dk.data(), x.dv = dv.data();
  x.scale = 0.125f, x.threads = threads;  // The logit scale 1 / sqrt(64).
  double best_fwd = 1e30, best_bwd = 1e30;
  for (int64_t it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    Forward<D>(x);
    const auto t1 = std::chrono::steady_clock::now();
    Backward<D>(x);
    const auto t2 = std::chrono::steady_clock::now();
    best_fwd = std::min(best_fwd, std::chrono::duration<double, std::milli>(t1 - t0).count());
    best_bwd = std::min(best_bwd, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  std::printf("%.3f %.3f %lld\n", best_fwd, best_bwd,
              static_cast<long long>(col.size() * T * T * items));
  return 0;
}
