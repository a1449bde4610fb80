// What the CPU kernels (blocksparse_cpu.cc, decode_cpu.cc) share: the thread fan-out inside
// an XLA FFI call, denormal flushing, and a vectorizable exp.
#ifndef ZOO_CPU_COMMON_H_
#define ZOO_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
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

namespace zoo_cpu {

namespace ffi = xla::ffi;

// Unaligned load and store of V, a GCC/Clang vector of floats (the kernels' SIMD registers).
template <typename V>
inline V LoadVector(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename V>
inline void Store(float* p, V x) {
  std::memcpy(p, &x, sizeof(x));
}

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

// Flushes denormal floats to zero while alive (tiny probability products would otherwise
// take the slow microcode path on x86; values below 1e-38 change nothing here); restores
// the thread's mode. Threads the kernel starts begin without it.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Where ParallelFor's helper threads come from: XLA's own CPU thread pool inside a call
// (Schedule), or threads started for the call and joined after it (no pool: the benchmark
// harness). In XLA's pool the kernel starts no threads of its own and adds none to those
// XLA already runs, so it does not oversubscribe the cores when XLA runs other work beside
// it. (Threads started per call were at times placed on the calling thread's core and
// moved off only milliseconds later: the two halves of strided's backward at 8K took 57
// and 47 ms in such a call, 34 ms each alone.)
class Helpers {
 public:
  explicit Helpers(ffi::ThreadPool* pool = nullptr) : pool_(pool) {}
  Helpers(const Helpers&) = delete;
  ~Helpers() {
    for (auto& th : started_) th.join();
  }

  void Run(std::function<void()> task) {
    if (pool_ != nullptr) {
      pool_->Schedule(std::move(task));
    } else {
      started_.emplace_back(std::move(task));
    }
  }

 private:
  ffi::ThreadPool* pool_;
  std::vector<std::thread> started_;
};

// Runs fn(i) for i in [0, count) on the calling thread and up to `threads` - 1 helpers, each
// taking the next index as it is free. Returns when every index is done. A helper that only
// starts after the calling thread has closed the job does nothing: XLA may run a scheduled
// task late, or on the calling thread itself, so the caller never waits for one that has
// not started.
template <typename Fn>
void ParallelFor(int64_t count, int64_t threads, Helpers& helpers, Fn fn) {
  threads = std::max<int64_t>(1, std::min(threads, count));
  struct Job {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable idle;
    int64_t running = 0;  // Helpers inside the loop.
    bool closed = false;
    std::function<void(int64_t)> fn;
    int64_t count = 0;
    void Loop() {
      FlushDenormals flush;
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) fn(i);
    }
  };
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->count = count;
  for (int64_t t = 1; t < threads; ++t) {
    helpers.Run([job] {
      {
        std::lock_guard<std::mutex> lock(job->mu);
        if (job->closed) return;
        ++job->running;
      }
      job->Loop();
      std::lock_guard<std::mutex> lock(job->mu);
      if (--job->running == 0) job->idle.notify_all();
    });
  }
  job->Loop();
  std::unique_lock<std::mutex> lock(job->mu);
  job->closed = true;
  job->idle.wait(lock, [&] { return job->running == 0; });
}

}  // namespace zoo_cpu

#endif  // ZOO_CPU_COMMON_H_
