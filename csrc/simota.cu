// CUDA kernels of SimOTA (fastdet/ops/simota.py is the reference; the plan and the shared
// arithmetic are in simota_math.h). No torch headers: the ATen glue is in ops_cuda.cpp.
//
//  0. simota_point_kernel, one thread per point: candidate flag and sum_c BCE(q_c, 0);
//  1. simota_gt_kernel, one block per real GT: every thread keeps its KMAX best keys in
//     registers for the IoUs and for the costs, then k rounds of a block max pop the
//     winners (block_topk.cuh, as the task-aligned kernel of kernels.cu). Cost keys pack
//     (in box and centre square, cost, point) so that a larger key is a cheaper point:
//     bit 62 = in both, bits 30..61 = the cost's bits inverted in an order-preserving
//     map, bits 0..29 = 0x3FFFFFFF - point. That is the CPU kernel's order (float64
//     cost + 1e5 if not in both) wherever float64 keeps the costs apart. Claimed points are
//     counted with atomics;
//  2. simota_resolve_kernel, one thread per point: one claim -> that GT; several -> the
//     GT of the largest key over all real GTs, the first on ties.
#include <cuda_runtime.h>

#include <cstdint>

#include "block_topk.cuh"
#include "cuda_kernels.h"
#include "simota_math.h"

namespace fastdet {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

// IoU keys: (IoU bits << 32) | (0xFFFFFFFF - point); IoUs are >= 0, so the bits order like the values.
__device__ __forceinline__ uint64_t iou_key(float iou, int64_t a) {
  return (static_cast<uint64_t>(__float_as_uint(iou)) << 32) |
         static_cast<uint64_t>(0xFFFFFFFFu - static_cast<uint32_t>(a));
}

// Cost keys (see the file comment); `a` < 2^30. Never 0, so 0 marks an empty slot.
__device__ __forceinline__ uint64_t cost_key(float cost, bool both, int64_t a) {
  uint32_t u = __float_as_uint(cost);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving map of the float to uint32
  return (static_cast<uint64_t>(both ? 1 : 0) << 62) | (static_cast<uint64_t>(0xFFFFFFFFu - u) << 30) |
         static_cast<uint64_t>(0x3FFFFFFFu - static_cast<uint32_t>(a)) | (1ull << 63);
}

__device__ __forceinline__ int64_t cost_key_point(uint64_t key) {
  return static_cast<int64_t>(0x3FFFFFFFu - static_cast<uint32_t>(key & 0x3FFFFFFFull));
}

__device__ __forceinline__ float simota_cost(const SimotaView<float>& v, int64_t b, int64_t m, int64_t a,
                                             float iou) {
  int64_t l = v.labels[b * v.M + m];
  l = l < 0 ? 0 : (l >= v.C ? v.C - 1 : l);
  const float q = sqrtf(v.scores[(b * v.A + a) * v.C + l]);
  const float cls = (v.neg_sum[b * v.A + a] - bce_neg(q)) + bce_pos(q);
  return cls + v.iou_weight * (-logf(iou + 1e-8f));
}

__global__ void simota_point_kernel(SimotaView<float> v, uint8_t* cand, float* neg_sum) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < v.B * v.A;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    v.point_info(i / v.A, i % v.A, cand + i, neg_sum + i);
  }
}

template <int KMAX>
__global__ void simota_gt_kernel(SimotaView<float> v, int k, int32_t* count, int32_t* owner) {
  __shared__ uint64_t smem[kThreads / 32];
  __shared__ uint64_t iou_win[KMAX];
  __shared__ uint64_t cost_win[KMAX];
  __shared__ int64_t dyn_k;
  const int64_t bm = blockIdx.x;
  if (!v.mask[bm]) return;  // padded slot (uniform per block)
  const int64_t b = bm / v.M, m = bm % v.M;
  KeyList<KMAX> ious, costs;
  ious.init();
  costs.init();
  for (int64_t a = threadIdx.x; a < v.A; a += kThreads) {
    if (!v.cand[b * v.A + a]) continue;
    bool in_box, in_ctr;
    v.inside(b, m, a, in_box, in_ctr);
    const float iou = v.iou(b, m, a);
    ious.push(iou_key(iou, a));
    costs.push(cost_key(simota_cost(v, b, m, a, iou), in_box && in_ctr, a));
  }
  block_topk<kThreads>(ious, k, iou_win, smem);
  block_topk<kThreads>(costs, k, cost_win, smem);
  if (threadIdx.x == 0) {
    // Empty slots are 0 keys (IoU 0): they add nothing, like the CPU kernel's shorter list.
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += static_cast<double>(__uint_as_float(static_cast<uint32_t>(iou_win[j] >> 32)));
    dyn_k = sum < 1.0 ? 1 : static_cast<int64_t>(sum);
  }
  __syncthreads();
  if (threadIdx.x < k && threadIdx.x < dyn_k && cost_win[threadIdx.x] != 0) {
    const int64_t ba = b * v.A + cost_key_point(cost_win[threadIdx.x]);
    atomicAdd(count + ba, 1);
    atomicExch(owner + ba, static_cast<int32_t>(m));  // read only where the count ends at 1
  }
}

__global__ void simota_resolve_kernel(SimotaView<float> v, const int32_t* count, const int32_t* owner,
                                      int64_t* out_gt, float* out_iou) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < v.B * v.A;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / v.A, a = i % v.A;
    int64_t m = -1;
    if (count[i] == 1) {
      m = owner[i];
    } else if (count[i] > 1) {
      uint64_t best = 0;
      for (int64_t j = 0; j < v.M; ++j) {
        if (!v.mask[b * v.M + j]) continue;
        bool in_box, in_ctr;
        v.inside(b, j, a, in_box, in_ctr);
        // The GT index in the low bits (inverted): ties go to the lower GT.
        const uint64_t key = cost_key(simota_cost(v, b, j, a, v.iou(b, j, a)), in_box && in_ctr, j);
        if (key > best) {
          best = key;
          m = j;
        }
      }
    }
    out_gt[i] = m;
    out_iou[i] = m < 0 ? 0.0f : v.iou(b, m, a);
  }
}

}  // namespace

void simota(const float* scores, const float* pred, const float* points, const float* strides, const float* gt,
            const int64_t* labels, const bool* mask, int64_t B, int64_t A, int64_t C, int64_t M, float radius,
            float iou_weight, int k, uint8_t* cand, float* neg_sum, int32_t* count, int32_t* owner, int64_t* out_gt,
            float* out_iou, cudaStream_t stream) {
  const SimotaView<float> v{scores, pred, points, strides, gt, labels, mask, cand, neg_sum, B, A, C, M, radius,
                            iou_weight};
  simota_point_kernel<<<grid_for(B * A), kThreads, 0, stream>>>(v, cand, neg_sum);
  const unsigned blocks = static_cast<unsigned>(B * M);
  if (k <= 16) {
    simota_gt_kernel<16><<<blocks, kThreads, 0, stream>>>(v, k, count, owner);
  } else {
    simota_gt_kernel<kSimotaMaxTopk><<<blocks, kThreads, 0, stream>>>(v, k, count, owner);
  }
  simota_resolve_kernel<<<grid_for(B * A), kThreads, 0, stream>>>(v, count, owner, out_gt, out_iou);
}

}  // namespace cuda
}  // namespace fastdet
