// CUDA kernel of fastdet.ops.fcos_assign (reference: fastdet/ops/fcos.py). One thread per
// (image, point); the image's ground-truth slots are staged through shared memory in
// tiles, so each box is read from global memory once per block, and every thread keeps
// only its running best (slot, area): no [B, M, A] tensor exists anywhere.
#include <cuda_runtime.h>

#include <cstdint>

#include "fcos.h"
#include "fcos_cuda.h"

namespace fastdet {
namespace cuda {
namespace {

constexpr int kFcosThreads = 256;

__global__ void fcos_assign_kernel(const float* __restrict__ points, const float* __restrict__ strides,
                                   const float* __restrict__ ranges, const float* __restrict__ boxes,
                                   const int64_t* __restrict__ labels, const bool* __restrict__ mask, int64_t M,
                                   int64_t A, float radius, int64_t* __restrict__ assigned,
                                   int64_t* __restrict__ assigned_labels) {
  __shared__ float4 tile_box[kFcosThreads];
  __shared__ bool tile_ok[kFcosThreads];
  const int64_t b = blockIdx.y;
  const int64_t a = static_cast<int64_t>(blockIdx.x) * kFcosThreads + threadIdx.x;
  const bool active = a < A;
  FcosPoint p{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active) {
    p = FcosPoint{points[2 * a], points[2 * a + 1], strides[a] * radius, ranges[2 * a], ranges[2 * a + 1]};
  }
  int64_t best = -1;
  float best_area = 0.0f;
  for (int64_t start = 0; start < M; start += kFcosThreads) {
    const int64_t m = start + threadIdx.x;
    if (m < M) {
      const float* g = boxes + (b * M + m) * 4;
      tile_box[threadIdx.x] = make_float4(g[0], g[1], g[2], g[3]);
      tile_ok[threadIdx.x] = mask[b * M + m];
    }
    __syncthreads();
    const int n = static_cast<int>(M - start < kFcosThreads ? M - start : kFcosThreads);
    if (active) {
      for (int j = 0; j < n; ++j) {
        if (!tile_ok[j]) continue;
        const float4 g = tile_box[j];
        const float area = fcos_candidate_area(p, g.x, g.y, g.z, g.w);
        // Strictly smaller: the first slot wins on equal areas, as argmin does.
        if (area >= 0.0f && (best < 0 || area < best_area)) {
          best = start + j;
          best_area = area;
        }
      }
    }
    __syncthreads();
  }
  if (active) {
    assigned[b * A + a] = best;
    assigned_labels[b * A + a] = best < 0 ? -1 : labels[b * M + best];
  }
}

}  // namespace

void fcos_assign(const float* points, const float* strides, const float* ranges, const float* boxes,
                 const int64_t* labels, const bool* mask, int64_t B, int64_t M, int64_t A, float radius,
                 int64_t* assigned, int64_t* assigned_labels, cudaStream_t stream) {
  if (B * A == 0) return;
  const dim3 grid(static_cast<unsigned>((A + kFcosThreads - 1) / kFcosThreads), static_cast<unsigned>(B));
  fcos_assign_kernel<<<grid, kFcosThreads, 0, stream>>>(points, strides, ranges, boxes, labels, mask, M, A, radius,
                                                        assigned, assigned_labels);
}

}  // namespace cuda
}  // namespace fastdet
