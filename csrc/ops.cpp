// Schemas of the fastdet custom ops and their CPU registrations. The CUDA
// registrations live in ops_cuda.cu; the fake (meta) implementations and the GIoU-loss
// autograd formula are registered from Python in fastdet/ops/_ext.py.
#include "ops.h"

#include <torch/library.h>

namespace fastdet {

void check_boxes(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == 4, "fastdet.ops.", op, ": ", name,
              " must have shape [..., 4] (xyxy boxes), got ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "fastdet.ops.", op, ": ", name,
              " must be a floating tensor, got ", t.scalar_type());
}

void check_pairwise(const at::Tensor& a, const at::Tensor& b, const char* op) {
  check_boxes(a, op, "a");
  check_boxes(b, op, "b");
  TORCH_CHECK((a.dim() == 2 && b.dim() == 2) || (a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0)),
              "fastdet.ops.", op, ": expected a [N,4] and b [M,4], or a [B,N,4] and b [B,M,4]; got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fastdet.ops.", op,
              ": a and b must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "fastdet.ops.", op, ": a and b must be on the same device");
}

void check_paired(const at::Tensor& pred, const at::Tensor& target, const char* op) {
  check_boxes(pred, op, "pred");
  check_boxes(target, op, "target");
  TORCH_CHECK(pred.sizes() == target.sizes(), "fastdet.ops.", op,
              ": pred and target must have the same shape, got ", pred.sizes(), " and ", target.sizes());
  TORCH_CHECK(pred.scalar_type() == target.scalar_type(), "fastdet.ops.", op,
              ": pred and target must have the same dtype");
  TORCH_CHECK(pred.device() == target.device(), "fastdet.ops.", op,
              ": pred and target must be on the same device");
}

bool same_dense_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || !a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;  // size-1 dims: any stride, same layout
  }
  return true;
}

void check_ema(at::TensorList ema, at::TensorList src, const at::Tensor& decay) {
  TORCH_CHECK(ema.size() == src.size(), "fastdet.ops.ema_update_: got ", ema.size(),
              " EMA tensors but ", src.size(), " source tensors");
  TORCH_CHECK(decay.numel() == 1 && at::isFloatingType(decay.scalar_type()),
              "fastdet.ops.ema_update_: decay must be a one-element floating tensor");
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(ema[i].sizes() == src[i].sizes(), "fastdet.ops.ema_update_: tensor ", i,
                " has shape ", ema[i].sizes(), " in the EMA but ", src[i].sizes(), " in the model");
    TORCH_CHECK(ema[i].device() == src[i].device() && ema[i].device() == decay.device(),
                "fastdet.ops.ema_update_: tensor ", i, " and decay must all be on one device");
  }
}

}  // namespace fastdet

TORCH_LIBRARY(fastdet, m) {
  m.def("box_iou(Tensor a, Tensor b, float eps) -> Tensor");
  m.def("generalized_box_iou(Tensor a, Tensor b, float eps) -> Tensor");
  m.def("giou_loss(Tensor pred, Tensor target, float eps) -> Tensor");
  m.def("giou_loss_backward(Tensor grad, Tensor pred, Tensor target, float eps) -> (Tensor, Tensor)");
  m.def("ema_update_(Tensor(a!)[] ema, Tensor[] src, Tensor decay) -> ()");
  m.def(
      "task_aligned_assign(Tensor pred_scores, Tensor pred_bboxes, Tensor anchor_points, "
      "Tensor gt_labels, Tensor gt_bboxes, Tensor pad_gt_mask, int bg_index, int topk, "
      "float alpha, float beta, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "atss_assign(Tensor anchors, SymInt[] num_anchors_list, Tensor gt_labels, Tensor gt_bboxes, "
      "Tensor pad_gt_mask, Tensor? pred_bboxes, int bg_index, int num_classes, int topk, "
      "float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "yolo_targets(Tensor gt_boxes, Tensor gt_labels, Tensor gt_mask, Tensor gt_scores, float[] anchors, "
      "int[] anchor_level, int[] anchor_slot, int[] strides, int img_h, int img_w, int num_classes) -> Tensor[]");
  m.def(
      "fcos_assign(Tensor points, Tensor strides, Tensor size_ranges, Tensor gt_boxes, Tensor gt_labels, "
      "Tensor gt_mask, float radius) -> (Tensor, Tensor)");
  m.def(
      "simota_assign(Tensor pred_scores, Tensor pred_boxes, Tensor anchor_points, Tensor strides, "
      "Tensor gt_boxes, Tensor gt_labels, Tensor gt_mask, float center_radius, int topk, "
      "float iou_weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastdet, CPU, m) {
  m.impl("box_iou", &fastdet::box_iou_cpu);
  m.impl("generalized_box_iou", &fastdet::generalized_box_iou_cpu);
  m.impl("giou_loss", &fastdet::giou_loss_cpu);
  m.impl("giou_loss_backward", &fastdet::giou_loss_backward_cpu);
  m.impl("ema_update_", &fastdet::ema_update_cpu);
  m.impl("task_aligned_assign", &fastdet::task_aligned_assign_cpu);
  m.impl("atss_assign", &fastdet::atss_assign_cpu);
  m.impl("yolo_targets", &fastdet::yolo_targets_cpu);
  m.impl("simota_assign", &fastdet::simota_assign_cpu);
}
