// Launchers of the CUDA kernels (kernels.cu). Plain C++ types only, so kernels.cu needs
// no torch headers (it compiles in seconds) and the torch-facing host code lives in
// ops_cuda.cpp. Every launcher enqueues on `stream` and returns without synchronising.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastdet {
namespace cuda {

enum class DType { kFloat, kDouble, kHalf, kBFloat16 };

// a [B,N,4] x b [B,M,4] -> out [B,N,M]
void pairwise(DType dt, const void* a, const void* b, void* out, int64_t B, int64_t N, int64_t M, double eps,
              bool giou, cudaStream_t stream);
// pred, target [n,4] -> out [n]; backward: grad [n] -> grad_pred, grad_target [n,4]
void giou_loss(DType dt, const void* pred, const void* target, void* out, int64_t n, double eps, cudaStream_t stream);
void giou_loss_backward(DType dt, const void* grad, const void* pred, const void* target, void* grad_pred,
                        void* grad_target, int64_t n, double eps, cudaStream_t stream);

struct EmaJob {
  void* dst;
  const void* src;
  int64_t numel;  // elements (lerp) or bytes (copy)
};
// dst = lerp(dst, src, 1 - decay) for every job; decay is a device scalar (float or double).
void ema_lerp(DType dt, const EmaJob* jobs, int64_t njobs, const void* decay, bool decay_is_double,
              cudaStream_t stream);
// dst = src byte for byte.
void ema_copy(const EmaJob* jobs, int64_t njobs, cudaStream_t stream);

// Ground truth of the assigners: boxes [B,M,4] f32, labels [B,M] i64, mask [B,M] f32.
struct GtView {
  const float* boxes;
  const int64_t* labels;
  const float* mask;
  int64_t M;
};
constexpr int kMaxTopk = 32;
constexpr int kMaxLevels = 8;

// Task-aligned: per GT, claim its top-k positive anchors (count [B,A] i32, owner [B,A] i32).
void tal_candidates(const float* scores, const float* pred, const float* points, GtView gt, int64_t B, int64_t A,
                    int64_t C, int k, float alpha, float beta, int32_t* count, int32_t* owner, cudaStream_t stream);
// ATSS: per GT and level, the topk nearest anchors and their IoUs -> cand, cand_iou [B,M,K].
void atss_candidates(const float* anchors, const float* centers, GtView gt, int64_t B, const int64_t* level_sizes,
                     int n_levels, int topk, int64_t K, int64_t* cand, float* cand_iou, cudaStream_t stream);
// ATSS: claim the candidates with IoU > thr [B,M] whose centre lies inside the GT.
void atss_claim(const float* centers, GtView gt, int64_t B, int64_t A, int64_t K, const int64_t* cand,
                const float* cand_iou, const float* thr, int32_t* count, int32_t* owner, cudaStream_t stream);
// Resolve every anchor to one GT (or background) and write labels [B,A], boxes [B,A,4] and
// the score value (TAL: metric, with per-GT maxima; ATSS: IoU with pred, or 1 without).
void resolve(bool tal, const float* scores, const float* pred, const float* anchors, GtView gt, int64_t B,
             int64_t A, int64_t C, float alpha, float beta, int64_t bg_index, const int32_t* count,
             const int32_t* owner, int32_t* assigned, float* value, float* max_metric, float* max_iou,
             int64_t* out_labels, float* out_bboxes, cudaStream_t stream);
// scores [B,A,C]: zero but the label's column.
void write_scores(bool tal, GtView gt, int64_t B, int64_t A, int64_t C, int64_t bg_index, float eps,
                  const int32_t* assigned, const float* value, const float* max_metric, const float* max_iou,
                  float* scores, cudaStream_t stream);

// SimOTA (simota.cu): scores [B,A,C], pred [B,A,4], points [A,2], strides [A], gt [B,M,4],
// labels [B,M], mask [B,M] -> out_gt [B,A] (-1 background), out_iou [B,A]. cand, neg_sum,
// count (zeroed) and owner are [B,A] scratch.
void simota(const float* scores, const float* pred, const float* points, const float* strides, const float* gt,
            const int64_t* labels, const bool* mask, int64_t B, int64_t A, int64_t C, int64_t M, float radius,
            float iou_weight, int k, uint8_t* cand, float* neg_sum, int32_t* count, int32_t* owner, int64_t* out_gt,
            float* out_iou, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastdet
