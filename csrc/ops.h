// Entry points of the fastdet custom ops (schemas in ops.cpp, Python fakes in
// fastdet/ops/_ext.py). Each has a CPU implementation (*_cpu.cpp) and a CUDA one
// (ops_cuda.cu); the dispatcher picks by the device of the tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <tuple>
#include <vector>

namespace fastdet {

// Pairwise IoU / GIoU: a [N,4] x b [M,4] -> [N,M], or a [B,N,4] x b [B,M,4] -> [B,N,M].
at::Tensor box_iou_cpu(const at::Tensor& a, const at::Tensor& b, double eps);
at::Tensor generalized_box_iou_cpu(const at::Tensor& a, const at::Tensor& b, double eps);
// Paired 1 - GIoU of pred [...,4] and target [...,4] -> [...], and its backward.
at::Tensor giou_loss_cpu(const at::Tensor& pred, const at::Tensor& target, double eps);
std::tuple<at::Tensor, at::Tensor> giou_loss_backward_cpu(const at::Tensor& grad,
                                                          const at::Tensor& pred,
                                                          const at::Tensor& target, double eps);
// ema[i] = lerp(ema[i], src[i], 1 - decay) for floating tensors, ema[i] = src[i] otherwise.
void ema_update_cpu(at::TensorList ema, at::TensorList src, const at::Tensor& decay);
// Task-aligned (TOOD / PP-YOLOE) and ATSS label assignment: see assign_cpu.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> task_aligned_assign_cpu(
    const at::Tensor& pred_scores, const at::Tensor& pred_bboxes, const at::Tensor& anchor_points,
    const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask,
    int64_t bg_index, int64_t topk, double alpha, double beta, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> atss_assign_cpu(
    const at::Tensor& anchors, c10::IntArrayRef num_anchors_list, const at::Tensor& gt_labels,
    const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask, const std::optional<at::Tensor>& pred_bboxes,
    int64_t bg_index, int64_t num_classes, int64_t topk, double eps);
// YOLOv3 grid targets (PaddleDetection Gt2YoloTarget): one [B, slots, 6 + C, H/s, W/s]
// tensor per level; see yolo_targets_cpu.cpp and yolo_targets.cu.
std::vector<at::Tensor> yolo_targets_cpu(const at::Tensor& gt_boxes, const at::Tensor& gt_labels,
                                         const at::Tensor& gt_mask, const at::Tensor& gt_scores,
                                         c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level,
                                         c10::IntArrayRef anchor_slot, c10::IntArrayRef strides, int64_t img_h,
                                         int64_t img_w, int64_t num_classes);
std::vector<at::Tensor> yolo_targets_cuda(const at::Tensor& gt_boxes, const at::Tensor& gt_labels,
                                          const at::Tensor& gt_mask, const at::Tensor& gt_scores,
                                          c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level,
                                          c10::IntArrayRef anchor_slot, c10::IntArrayRef strides, int64_t img_h,
                                          int64_t img_w, int64_t num_classes);
// SimOTA (YOLOX): see simota_math.h. Returns (assigned_gt [B,A] int64, assigned_iou [B,A]).
std::tuple<at::Tensor, at::Tensor> simota_assign_cpu(const at::Tensor& pred_scores, const at::Tensor& pred_boxes,
                                                     const at::Tensor& anchor_points, const at::Tensor& strides,
                                                     const at::Tensor& gt_boxes, const at::Tensor& gt_labels,
                                                     const at::Tensor& gt_mask, double center_radius, int64_t topk,
                                                     double iou_weight);
// Checks SimOTA's arguments (simota_cpu.cpp); returns {B, A, C, M}.
std::array<int64_t, 4> check_simota(const at::Tensor& pred_scores, const at::Tensor& pred_boxes,
                                    const at::Tensor& anchor_points, const at::Tensor& strides,
                                    const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                                    int64_t topk, const char* op);

// Shared argument checks (ops.cpp); each throws a one-line error naming the op and argument.
void check_boxes(const at::Tensor& t, const char* op, const char* name);
void check_pairwise(const at::Tensor& a, const at::Tensor& b, const char* op);
void check_paired(const at::Tensor& pred, const at::Tensor& target, const char* op);
void check_ema(at::TensorList ema, at::TensorList src, const at::Tensor& decay);
// Whether a and b hold their elements in one dense block each, in the same order
// (both contiguous, both channels-last, or any other same permutation): the fused EMA
// kernels then treat each as a flat array of numel() elements from data_ptr().
bool same_dense_layout(const at::Tensor& a, const at::Tensor& b);

}  // namespace fastdet
