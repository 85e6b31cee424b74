// CUDA kernels of fastdet.ops: IoU family, fused EMA, task-aligned and ATSS assigners.
// No torch headers here (fast to compile); the torch-facing side is ops_cuda.cpp. The box
// formulas are shared with the CPU kernels through box_math.h, so CPU and CUDA agree.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "block_topk.cuh"
#include "box_math.h"
#include "cuda_kernels.h"

namespace fastdet {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline unsigned grid_for(int64_t n) {
  // Grid-stride kernels: enough blocks to fill the GPU, capped so the grid stays legal.
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)));
}

#define FD_GRID_STRIDE(i, n)                                                              \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Accumulation type and conversions: float for half/bfloat16 storage, as at::opmath_type.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Calls f(T{}) with T the storage type of dt.
template <typename F>
void dispatch(DType dt, F f) {
  switch (dt) {
    case DType::kFloat: f(float{}); break;
    case DType::kDouble: f(double{}); break;
    case DType::kHalf: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

// ----------------------------------------------------------------------------- IoU family

template <typename T, bool kGiou>
__global__ void pairwise_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t N,
                                int64_t M, int64_t total, typename Acc<T>::type eps) {
  using acc_t = typename Acc<T>::type;
  FD_GRID_STRIDE(i, total) {
    const int64_t j = i % M, r = i / M, bi = r / N;
    const T* pa = a + 4 * r;
    const T* pb = b + 4 * (bi * M + j);
    const acc_t ax1 = to_acc(pa[0]), ay1 = to_acc(pa[1]), ax2 = to_acc(pa[2]), ay2 = to_acc(pa[3]);
    const acc_t bx1 = to_acc(pb[0]), by1 = to_acc(pb[1]), bx2 = to_acc(pb[2]), by2 = to_acc(pb[3]);
    const acc_t area_a = clamped_area(ax1, ay1, ax2, ay2), area_b = clamped_area(bx1, by1, bx2, by2);
    const acc_t v = kGiou ? pair_giou(ax1, ay1, ax2, ay2, area_a, bx1, by1, bx2, by2, area_b, eps)
                          : pair_iou(ax1, ay1, ax2, ay2, area_a, bx1, by1, bx2, by2, area_b, eps);
    out[i] = from_acc<T>(v);
  }
}

template <typename T>
__global__ void giou_loss_kernel(const T* __restrict__ p, const T* __restrict__ t, T* __restrict__ out, int64_t n,
                                 typename Acc<T>::type eps) {
  using acc_t = typename Acc<T>::type;
  FD_GRID_STRIDE(i, n) {
    acc_t pb[4], tb[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      pb[k] = to_acc(p[4 * i + k]);
      tb[k] = to_acc(t[4 * i + k]);
    }
    out[i] = from_acc<T>(giou_loss_fwd(pb, tb, eps));
  }
}

template <typename T>
__global__ void giou_loss_backward_kernel(const T* __restrict__ g, const T* __restrict__ p, const T* __restrict__ t,
                                          T* __restrict__ gp, T* __restrict__ gt, int64_t n,
                                          typename Acc<T>::type eps) {
  using acc_t = typename Acc<T>::type;
  FD_GRID_STRIDE(i, n) {
    acc_t pb[4], tb[4], dp[4], dt[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      pb[k] = to_acc(p[4 * i + k]);
      tb[k] = to_acc(t[4 * i + k]);
    }
    giou_loss_bwd(pb, tb, eps, to_acc(g[i]), dp, dt);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      gp[4 * i + k] = from_acc<T>(dp[k]);
      gt[4 * i + k] = from_acc<T>(dt[k]);
    }
  }
}

// ----------------------------------------------------------------------------- fused EMA
//
// A multi-tensor launch: the tensor table and the block -> (tensor, chunk) map travel in
// the kernel's parameter block (__grid_constant__, up to 32 KiB on sm_70+ with CUDA >= 12.1),
// so nothing is copied host -> device and a CUDA graph captures the launch as is. The
// ~300 tensors of a detector fit in one or two launches.

constexpr int kEmaTensors = 320;
constexpr int kEmaBlocks = 1024;
constexpr int64_t kEmaChunk = 16384;  // elements (or bytes) per block

struct EmaArgs {
  void* dst[kEmaTensors];
  const void* src[kEmaTensors];
  int64_t numel[kEmaTensors];
  int16_t block_tensor[kEmaBlocks];
  int32_t block_chunk[kEmaBlocks];
};
static_assert(sizeof(EmaArgs) < 32000, "EmaArgs must fit the 32 KiB kernel parameter limit");

template <typename T, typename D>
__global__ void ema_lerp_kernel(const __grid_constant__ EmaArgs args, const D* __restrict__ decay) {
  using acc_t = typename Acc<T>::type;
  const int t = args.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kEmaChunk;
  const int64_t end = args.numel[t] < start + kEmaChunk ? args.numel[t] : start + kEmaChunk;
  T* e = static_cast<T*>(args.dst[t]);
  const T* s = static_cast<const T*>(args.src[t]);
  const acc_t w = static_cast<acc_t>(D(1) - decay[0]);  // 1 - decay in the decay's dtype
  constexpr int kVec = 16 / sizeof(T);
  struct alignas(16) Pack {
    T v[kVec];
  };
  int64_t tail = start;
  if (((reinterpret_cast<uintptr_t>(e) | reinterpret_cast<uintptr_t>(s)) % 16) == 0) {
    const int64_t vec_end = start + ((end - start) / kVec) * kVec;
    for (int64_t k = start + static_cast<int64_t>(threadIdx.x) * kVec; k < vec_end;
         k += static_cast<int64_t>(blockDim.x) * kVec) {
      Pack pe = *reinterpret_cast<const Pack*>(e + k);
      const Pack ps = *reinterpret_cast<const Pack*>(s + k);
#pragma unroll
      for (int v = 0; v < kVec; ++v) pe.v[v] = from_acc<T>(lerp_<acc_t>(to_acc(pe.v[v]), to_acc(ps.v[v]), w));
      *reinterpret_cast<Pack*>(e + k) = pe;
    }
    tail = vec_end;
  }
  for (int64_t k = tail + threadIdx.x; k < end; k += blockDim.x) {
    e[k] = from_acc<T>(lerp_<acc_t>(to_acc(e[k]), to_acc(s[k]), w));
  }
}

__global__ void ema_copy_kernel(const __grid_constant__ EmaArgs args) {
  const int t = args.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kEmaChunk;
  const int64_t end = args.numel[t] < start + kEmaChunk ? args.numel[t] : start + kEmaChunk;
  uint8_t* e = static_cast<uint8_t*>(args.dst[t]);
  const uint8_t* s = static_cast<const uint8_t*>(args.src[t]);
  for (int64_t k = start + threadIdx.x; k < end; k += blockDim.x) e[k] = s[k];
}

// Packs jobs into EmaArgs tables and calls launch(args, blocks) for each full table.
template <typename Launch>
void multi_tensor_apply(const EmaJob* jobs, int64_t njobs, Launch launch) {
  EmaArgs args;
  int tensors = 0, blocks = 0;
  for (int64_t i = 0; i < njobs; ++i) {
    const int64_t n = jobs[i].numel;
    if (n == 0) continue;
    const int64_t chunks = ceil_div(n, kEmaChunk);
    bool placed = false;
    for (int64_t c = 0; c < chunks; ++c) {
      if (blocks == kEmaBlocks || (!placed && tensors == kEmaTensors)) {
        launch(args, blocks);
        // A tensor cut across launches continues as the first entry of the next table.
        tensors = 0;
        blocks = 0;
        placed = false;
      }
      if (!placed) {
        args.dst[tensors] = jobs[i].dst;
        args.src[tensors] = jobs[i].src;
        args.numel[tensors] = n;
        ++tensors;
        placed = true;
      }
      args.block_tensor[blocks] = static_cast<int16_t>(tensors - 1);
      args.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
    }
  }
  if (blocks > 0) launch(args, blocks);
}

// ----------------------------------------------------------------------------- assigners
//
// One block per ground-truth box selects its candidates with a block-wide top-k
// (block_topk.cuh): every thread keeps its KMAX best keys in registers, then k rounds of a
// block max pop the winners (k <= KMAX, so no thread can hold more winners than it keeps). A key packs
// (value bits << 32) | (0xFFFFFFFF - anchor): larger is better and ties go to the lower
// anchor index, as in the CPU kernel. Positive candidates are counted per anchor with
// atomics; resolve_kernel settles each anchor, scores_kernel writes [B, A, C]. No
// [B, M, A] tensor is formed.

__device__ __forceinline__ uint64_t make_key(uint32_t hi, int64_t anchor) {
  return (static_cast<uint64_t>(hi) << 32) | static_cast<uint64_t>(0xFFFFFFFFu - static_cast<uint32_t>(anchor));
}

__device__ __forceinline__ int64_t key_anchor(uint64_t key) {
  return static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFull));
}

__device__ __forceinline__ void claim(int32_t* count, int32_t* owner, int64_t ba, int32_t m) {
  atomicAdd(count + ba, 1);
  atomicExch(owner + ba, m);  // read only where the count ends at 1, i.e. one writer
}

__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  // For non-negative floats the IEEE bit pattern orders like the value.
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(fmaxf(v, 0.0f)));
}

__device__ __forceinline__ float tal_metric(const float* S, int64_t C, int64_t ba, int64_t label, float iou,
                                            float alpha, float beta) {
  const float s = (label >= 0 && label < C) ? S[ba * C + label] : 0.0f;
  return powf(s, alpha) * powf(iou, beta);
}

template <int KMAX>
__global__ void tal_candidates_kernel(const float* __restrict__ S, const float* __restrict__ P,
                                      const float* __restrict__ pts, GtView gt, int64_t A, int64_t C, int k,
                                      float alpha, float beta, int32_t* count, int32_t* owner) {
  __shared__ uint64_t smem[kThreads / 32];
  __shared__ uint64_t winners[KMAX];
  const int64_t bm = blockIdx.x;
  if (gt.mask[bm] == 0.0f) return;  // padded slot: never a candidate (uniform per block)
  const int64_t b = bm / gt.M;
  const float* g = gt.boxes + 4 * bm;
  const float gx1 = g[0], gy1 = g[1], gx2 = g[2], gy2 = g[3];
  const int64_t label = gt.labels[bm];
  KeyList<KMAX> list;
  list.init();
  for (int64_t a = threadIdx.x; a < A; a += kThreads) {
    float v = 0.0f;
    if (point_inside(pts[2 * a], pts[2 * a + 1], gx1, gy1, gx2, gy2, 1e-9f)) {
      const float* p = P + 4 * (b * A + a);
      const float iou = paddle_iou(gx1, gy1, gx2, gy2, p[0], p[1], p[2], p[3], 1e-9f);
      v = tal_metric(S, C, b * A + a, label, iou, alpha, beta);
    }
    list.push(make_key(__float_as_uint(v), a));
  }
  block_topk<kThreads>(list, k, winners, smem);
  if (threadIdx.x < k) {
    const int64_t a = key_anchor(winners[threadIdx.x]);
    if (point_inside(pts[2 * a], pts[2 * a + 1], gx1, gy1, gx2, gy2, 1e-9f)) {
      claim(count, owner, b * A + a, static_cast<int32_t>(bm - b * gt.M));
    }
  }
}

struct Levels {
  int64_t start[kMaxLevels];
  int64_t size[kMaxLevels];
  int n;
};

// Each GT's candidates: the topk nearest anchor centres per level, with their IoUs
// (cand [B, M, K], cand_iou [B, M, K]; padded slots keep IoU 0, like the reference).
template <int KMAX>
__global__ void atss_candidates_kernel(const float* __restrict__ anchors, const float* __restrict__ centers,
                                       GtView gt, Levels levels, int topk, int64_t K, int64_t* __restrict__ cand,
                                       float* __restrict__ cand_iou) {
  __shared__ uint64_t smem[kThreads / 32];
  __shared__ uint64_t winners[KMAX];
  const int64_t bm = blockIdx.x;
  if (gt.mask[bm] == 0.0f) return;
  const float* g = gt.boxes + 4 * bm;
  const float gx1 = g[0], gy1 = g[1], gx2 = g[2], gy2 = g[3];
  const float gcx = (gx1 + gx2) / 2.0f, gcy = (gy1 + gy2) / 2.0f;
  int64_t j = 0;
  for (int l = 0; l < levels.n; ++l) {
    const int kl = static_cast<int>(topk < levels.size[l] ? topk : levels.size[l]);
    KeyList<KMAX> list;
    list.init();
    const int64_t end = levels.start[l] + levels.size[l];
    for (int64_t a = levels.start[l] + threadIdx.x; a < end; a += kThreads) {
      const double dx = static_cast<double>(gcx - centers[2 * a]), dy = static_cast<double>(gcy - centers[2 * a + 1]);
      const float d = static_cast<float>(sqrt(dx * dx + dy * dy));
      list.push(make_key(0xFFFFFFFFu - __float_as_uint(d), a));  // nearer is larger
    }
    block_topk<kThreads>(list, kl, winners, smem);
    if (threadIdx.x < kl) {
      const int64_t a = key_anchor(winners[threadIdx.x]);
      const float* an = anchors + 4 * a;
      cand[bm * K + j + threadIdx.x] = a;
      cand_iou[bm * K + j + threadIdx.x] = paddle_iou(gx1, gy1, gx2, gy2, an[0], an[1], an[2], an[3], 1e-9f);
    }
    j += kl;
    __syncthreads();
  }
}

__global__ void atss_claim_kernel(const float* __restrict__ centers, GtView gt, int64_t A, int64_t K, int64_t total,
                                  const int64_t* __restrict__ cand, const float* __restrict__ cand_iou,
                                  const float* __restrict__ thr, int32_t* count, int32_t* owner) {
  FD_GRID_STRIDE(i, total) {
    const int64_t bm = i / K;
    if (gt.mask[bm] == 0.0f || !(cand_iou[i] > thr[bm])) continue;
    const int64_t a = cand[i], b = bm / gt.M;
    const float* g = gt.boxes + 4 * bm;
    if (point_inside(centers[2 * a], centers[2 * a + 1], g[0], g[1], g[2], g[3], 1e-9f)) {
      claim(count, owner, b * A + a, static_cast<int32_t>(bm - b * gt.M));
    }
  }
}

template <bool kTal>
__global__ void resolve_kernel(const float* __restrict__ S, const float* __restrict__ P,
                               const float* __restrict__ anchors, GtView gt, int64_t B, int64_t A, int64_t C,
                               float alpha, float beta, int64_t bg_index, const int32_t* __restrict__ count,
                               const int32_t* __restrict__ owner, int32_t* __restrict__ assigned,
                               float* __restrict__ value, float* __restrict__ max_metric, float* __restrict__ max_iou,
                               int64_t* __restrict__ out_labels, float* __restrict__ out_bboxes) {
  FD_GRID_STRIDE(ba, B * A) {
    const int64_t b = ba / A, a = ba % A;
    // The tie-break IoU: with the predicted box (TAL) or the anchor box (ATSS).
    const float* q = kTal ? P + 4 * ba : anchors + 4 * a;
    const float qx1 = q[0], qy1 = q[1], qx2 = q[2], qy2 = q[3];
    const int c = count[ba];
    int32_t m = -1;
    if (c == 1) {
      m = owner[ba];
    } else if (c > 1) {
      // Several claimants: the GT of highest IoU x pad mask over all M slots, first on ties.
      float best = 0.0f;
      for (int64_t j = 0; j < gt.M; ++j) {
        const float* g = gt.boxes + 4 * (b * gt.M + j);
        const float v = paddle_iou(g[0], g[1], g[2], g[3], qx1, qy1, qx2, qy2, 1e-9f) * gt.mask[b * gt.M + j];
        if (j == 0 || v > best) {
          best = v;
          m = static_cast<int32_t>(j);
        }
      }
    }
    assigned[ba] = m;
    const int64_t gm = b * gt.M + (m < 0 ? 0 : m);
    const float* g = gt.boxes + 4 * gm;
    out_labels[ba] = m < 0 ? bg_index : gt.labels[gm];
#pragma unroll
    for (int k = 0; k < 4; ++k) out_bboxes[4 * ba + k] = g[k];
    if (m < 0) continue;
    if (kTal) {
      const float iou = paddle_iou(g[0], g[1], g[2], g[3], qx1, qy1, qx2, qy2, 1e-9f);
      const float metric = tal_metric(S, C, ba, gt.labels[gm], iou, alpha, beta);
      value[ba] = metric;
      atomic_max_nonneg(max_metric + gm, metric);
      atomic_max_nonneg(max_iou + gm, iou);
    } else if (P != nullptr) {
      const float* p = P + 4 * ba;
      value[ba] = paddle_iou(g[0], g[1], g[2], g[3], p[0], p[1], p[2], p[3], 1e-9f);
    } else {
      value[ba] = 1.0f;
    }
  }
}

template <bool kTal>
__global__ void scores_kernel(GtView gt, int64_t A, int64_t C, int64_t total, int64_t bg_index, float eps,
                              const int32_t* __restrict__ assigned, const float* __restrict__ value,
                              const float* __restrict__ max_metric, const float* __restrict__ max_iou,
                              float* __restrict__ scores) {
  FD_GRID_STRIDE(i, total) {
    const int64_t ba = i / C, c = i % C;
    const int32_t m = assigned[ba];
    float out = 0.0f;
    if (m >= 0) {
      const int64_t gm = (ba / A) * gt.M + m;
      if (score_column(gt.labels[gm], bg_index, C) == c) {
        out = kTal ? value[ba] / (max_metric[gm] + eps) * max_iou[gm] : value[ba];
      }
    }
    scores[i] = out;
  }
}

}  // namespace

void pairwise(DType dt, const void* a, const void* b, void* out, int64_t B, int64_t N, int64_t M, double eps,
              bool giou, cudaStream_t stream) {
  const int64_t total = B * N * M;
  if (total == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    using acc_t = typename Acc<T>::type;
    auto* pa = static_cast<const T*>(a);
    auto* pb = static_cast<const T*>(b);
    auto* po = static_cast<T*>(out);
    if (giou) {
      pairwise_kernel<T, true><<<grid_for(total), kThreads, 0, stream>>>(pa, pb, po, N, M, total, acc_t(eps));
    } else {
      pairwise_kernel<T, false><<<grid_for(total), kThreads, 0, stream>>>(pa, pb, po, N, M, total, acc_t(eps));
    }
  });
}

void giou_loss(DType dt, const void* pred, const void* target, void* out, int64_t n, double eps, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    giou_loss_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(pred),
                                                              static_cast<const T*>(target), static_cast<T*>(out), n,
                                                              typename Acc<T>::type(eps));
  });
}

void giou_loss_backward(DType dt, const void* grad, const void* pred, const void* target, void* grad_pred,
                        void* grad_target, int64_t n, double eps, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    giou_loss_backward_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(pred), static_cast<const T*>(target),
        static_cast<T*>(grad_pred), static_cast<T*>(grad_target), n, typename Acc<T>::type(eps));
  });
}

void ema_lerp(DType dt, const EmaJob* jobs, int64_t njobs, const void* decay, bool decay_is_double,
              cudaStream_t stream) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    multi_tensor_apply(jobs, njobs, [&](const EmaArgs& args, int blocks) {
      if (decay_is_double) {
        ema_lerp_kernel<T, double><<<blocks, kThreads, 0, stream>>>(args, static_cast<const double*>(decay));
      } else {
        ema_lerp_kernel<T, float><<<blocks, kThreads, 0, stream>>>(args, static_cast<const float*>(decay));
      }
    });
  });
}

void ema_copy(const EmaJob* jobs, int64_t njobs, cudaStream_t stream) {
  multi_tensor_apply(jobs, njobs, [&](const EmaArgs& args, int blocks) {
    ema_copy_kernel<<<blocks, kThreads, 0, stream>>>(args);
  });
}

void tal_candidates(const float* scores, const float* pred, const float* points, GtView gt, int64_t B, int64_t A,
                    int64_t C, int k, float alpha, float beta, int32_t* count, int32_t* owner, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(B * gt.M);
  if (k <= 16) {
    tal_candidates_kernel<16><<<blocks, kThreads, 0, stream>>>(scores, pred, points, gt, A, C, k, alpha, beta, count,
                                                               owner);
  } else {
    tal_candidates_kernel<kMaxTopk><<<blocks, kThreads, 0, stream>>>(scores, pred, points, gt, A, C, k, alpha, beta,
                                                                     count, owner);
  }
}

void atss_candidates(const float* anchors, const float* centers, GtView gt, int64_t B, const int64_t* level_sizes,
                     int n_levels, int topk, int64_t K, int64_t* cand, float* cand_iou, cudaStream_t stream) {
  Levels levels{};
  levels.n = n_levels;
  int64_t start = 0;
  for (int l = 0; l < n_levels; ++l) {
    levels.start[l] = start;
    levels.size[l] = level_sizes[l];
    start += level_sizes[l];
  }
  const unsigned blocks = static_cast<unsigned>(B * gt.M);
  if (topk <= 16) {
    atss_candidates_kernel<16><<<blocks, kThreads, 0, stream>>>(anchors, centers, gt, levels, topk, K, cand, cand_iou);
  } else {
    atss_candidates_kernel<kMaxTopk><<<blocks, kThreads, 0, stream>>>(anchors, centers, gt, levels, topk, K, cand,
                                                                      cand_iou);
  }
}

void atss_claim(const float* centers, GtView gt, int64_t B, int64_t A, int64_t K, const int64_t* cand,
                const float* cand_iou, const float* thr, int32_t* count, int32_t* owner, cudaStream_t stream) {
  const int64_t total = B * gt.M * K;
  if (total == 0) return;
  atss_claim_kernel<<<grid_for(total), kThreads, 0, stream>>>(centers, gt, A, K, total, cand, cand_iou, thr, count,
                                                              owner);
}

void resolve(bool tal, const float* scores, const float* pred, const float* anchors, GtView gt, int64_t B,
             int64_t A, int64_t C, float alpha, float beta, int64_t bg_index, const int32_t* count,
             const int32_t* owner, int32_t* assigned, float* value, float* max_metric, float* max_iou,
             int64_t* out_labels, float* out_bboxes, cudaStream_t stream) {
  if (tal) {
    resolve_kernel<true><<<grid_for(B * A), kThreads, 0, stream>>>(scores, pred, anchors, gt, B, A, C, alpha, beta,
                                                                  bg_index, count, owner, assigned, value, max_metric,
                                                                  max_iou, out_labels, out_bboxes);
  } else {
    resolve_kernel<false><<<grid_for(B * A), kThreads, 0, stream>>>(scores, pred, anchors, gt, B, A, C, alpha, beta,
                                                                   bg_index, count, owner, assigned, value,
                                                                   max_metric, max_iou, out_labels, out_bboxes);
  }
}

void write_scores(bool tal, GtView gt, int64_t B, int64_t A, int64_t C, int64_t bg_index, float eps,
                  const int32_t* assigned, const float* value, const float* max_metric, const float* max_iou,
                  float* scores, cudaStream_t stream) {
  const int64_t total = B * A * C;
  if (total == 0) return;
  if (tal) {
    scores_kernel<true><<<grid_for(total), kThreads, 0, stream>>>(gt, A, C, total, bg_index, eps, assigned, value,
                                                                  max_metric, max_iou, scores);
  } else {
    scores_kernel<false><<<grid_for(total), kThreads, 0, stream>>>(gt, A, C, total, bg_index, eps, assigned, value,
                                                                   max_metric, max_iou, scores);
  }
}

}  // namespace cuda
}  // namespace fastdet
