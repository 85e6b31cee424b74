// CUDA kernels of fastdet.ops.yolo_targets (PaddleDetection Gt2YoloTarget on the device).
//
// Deterministic although boxes run in parallel: a plain scatter of duplicates (two boxes
// on one anchor and cell) would keep whichever thread wrote last. Instead,
//   1. yolo_claim: every box atomicMax-es its index into its cell's winner (an integer
//      maximum does not depend on the order of the atomics): the later box wins, as in
//      Paddle's loop;
//   2. yolo_write: only the winner writes the six values; every box writes 1 into its class
//      channel (all writers of an element write the same 1, so order does not matter;
//      Paddle's loop also leaves both class channels set).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "yolo_targets_cuda.h"

namespace fastdet {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

#define FD_YOLO_LOOP(i, n)                                                                \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

__global__ void yolo_claim(YoloSpec s, YoloView v, int64_t B, int64_t M, YoloOut o) {
  FD_YOLO_LOOP(i, B * M) {
    YoloHit hit;
    const float* g = v.boxes + 4 * i;
    if (!yolo_hit(s, g[0], g[1], g[2], g[3], v.scores[i], v.mask[i], &hit)) continue;
    const int l = hit.level;
    const int64_t cells = s.slots[l] * s.grid_h[l] * s.grid_w[l];
    atomicMax(o.winner[l] + (i / M) * cells + hit.cell, static_cast<int32_t>(i % M));
  }
}

__global__ void yolo_write(YoloSpec s, YoloView v, int64_t B, int64_t M, YoloOut o) {
  FD_YOLO_LOOP(i, B * M) {
    YoloHit hit;
    const float* g = v.boxes + 4 * i;
    if (!yolo_hit(s, g[0], g[1], g[2], g[3], v.scores[i], v.mask[i], &hit)) continue;
    const int l = hit.level;
    const int64_t b = i / M, hw = s.grid_h[l] * s.grid_w[l], cells = s.slots[l] * hw;
    const int64_t slot = hit.cell / hw, pix = hit.cell % hw;
    float* t = o.out[l] + (b * s.slots[l] + slot) * (6 + s.C) * hw + pix;  // channel 0
    if (o.winner[l][b * cells + hit.cell] == static_cast<int32_t>(i % M)) {
      for (int c = 0; c < 6; ++c) t[c * hw] = hit.v[c];
    }
    const int64_t label = min_<int64_t>(max_<int64_t>(v.labels[i], 0), s.C - 1);
    t[(6 + label) * hw] = 1.0f;
  }
}

}  // namespace

void yolo_targets(const YoloSpec& s, YoloView v, int64_t B, int64_t M, YoloOut o, cudaStream_t stream) {
  const unsigned blocks = blocks_for(B * M);
  yolo_claim<<<blocks, kThreads, 0, stream>>>(s, v, B, M, o);
  yolo_write<<<blocks, kThreads, 0, stream>>>(s, v, B, M, o);
}

}  // namespace cuda
}  // namespace fastdet
