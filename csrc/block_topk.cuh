// Block-wide top-k over 64-bit keys, shared by the task-aligned / ATSS assigner kernels
// (kernels.cu) and SimOTA's (simota.cu).
//
// Every thread keeps its KMAX best keys in registers (KeyList, sorted, 0 = empty), then
// k rounds of a block max pop the winners: round r's winner is the r-th largest key of the
// whole block, and k <= KMAX guarantees no thread can hold more winners than it keeps.
// The callers pack their keys so that a larger key is a better candidate and ties break on
// the index (value bits in the high word, inverted index in the low word), which is the
// CPU kernels' order. Device code only (templates, so each .cu instantiates its own).
#pragma once

#include <cstdint>

template <int KMAX>
struct KeyList {
  uint64_t v[KMAX];
  __device__ void init() {
#pragma unroll
    for (int i = 0; i < KMAX; ++i) v[i] = 0;
  }
  __device__ void push(uint64_t key) {
    if (key <= v[KMAX - 1]) return;
    v[KMAX - 1] = key;
#pragma unroll
    for (int i = KMAX - 1; i > 0; --i) {
      if (v[i] > v[i - 1]) {
        const uint64_t tmp = v[i];
        v[i] = v[i - 1];
        v[i - 1] = tmp;
      }
    }
  }
  __device__ void pop() {
#pragma unroll
    for (int i = 0; i < KMAX - 1; ++i) v[i] = v[i + 1];
    v[KMAX - 1] = 0;
  }
};

// The largest x over a block of THREADS threads (a multiple of 32, at most 1024); smem holds
// THREADS / 32 keys. Every thread gets the result.
template <int THREADS>
__device__ uint64_t block_max(uint64_t x, uint64_t* smem) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "a block of whole warps, at most 32 of them");
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, x, off);
    x = o > x ? o : x;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < (THREADS / 32) ? smem[lane] : 0;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, x, off);
      x = o > x ? o : x;
    }
    if (lane == 0) smem[0] = x;
  }
  __syncthreads();
  const uint64_t r = smem[0];
  __syncthreads();
  return r;
}

// k rounds of block max over the per-thread lists; winners[r] receives the r-th best key
// (0 once the block has fewer than r + 1 keys).
template <int THREADS, int KMAX>
__device__ void block_topk(KeyList<KMAX>& list, int k, uint64_t* winners, uint64_t* smem) {
  for (int r = 0; r < k; ++r) {
    const uint64_t best = block_max<THREADS>(list.v[0], smem);
    if (best != 0 && list.v[0] == best) list.pop();
    if (threadIdx.x == 0) winners[r] = best;
  }
  __syncthreads();
}
