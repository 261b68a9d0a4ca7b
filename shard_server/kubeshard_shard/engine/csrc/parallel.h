// Work over [0, n) in chunks: each thread walks its own equal share from the front, as
// at::parallel_for's fixed ranges do, and a thread done with its share takes the chunks
// still left in another's from that share's back.
//
// Why: a decode step makes a hundred or more parallel GEMMs, each a few tens of
// microseconds at batch 1, and with fixed halves the first thread waited at each one's
// end for the second, which starts later (it wakes from its wait for work) or reads
// slower: in a profile of the default model's int4 decode (perf, 2026-12-08, EPYC Zen 4,
// 2 cores) the first thread spent a tenth of the step in OpenMP's barrier. Why each
// share is walked in order and stolen from the back: chunks handed out in turn from one
// counter (32 rows of W each) made the int4 decode step 0.70x as fast, every thread's
// reads of W a series of short runs the hardware prefetcher had to find anew; this way,
// against the fixed halves in one process (bench.decode_ab, same day and machine): the
// int4 decode step 1.025x, 0.991x and 1.041x in three runs of 10 rounds (each decode
// 0.82-1.20), int8 1.026x (6 rounds); the first thread's share of the profile in that
// barrier halved. A small gain, in the noise of one run. Which thread computes a row does
// not change its bits.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace ks {

// A share's chunks not yet taken, [front, back), in one word so that its owner (from the
// front) and a thief (from the back) never both take the same chunk.
struct alignas(64) ChunkShare {
  std::atomic<uint64_t> range;

  static uint64_t pack(uint32_t front, uint32_t back) { return (uint64_t(back) << 32) | front; }
  // the next chunk from the front (from_back: the back), or -1 when none is left
  int64_t take(bool from_back) {
    uint64_t r = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = uint32_t(r), back = uint32_t(r >> 32);
      if (front >= back) return -1;
      const uint64_t next = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (range.compare_exchange_weak(r, next, std::memory_order_relaxed)) return from_back ? back - 1 : front;
    }
  }
};

template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(int64_t{0}, n);
    return;
  }
  std::vector<ChunkShare> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].range.store(ChunkShare::pack(uint32_t(t * chunks / threads), uint32_t((t + 1) * chunks / threads)));
  auto run = [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {
    for (int64_t c; (c = shares[t0].take(false)) >= 0;) run(c);
    for (int64_t u = 1; u < threads; ++u)
      for (int64_t c; (c = shares[(t0 + u) % threads].take(true)) >= 0;) run(c);
  });
}

}  // namespace ks
