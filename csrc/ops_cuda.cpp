// CUDA registrations of the fastdet ops: argument checks, allocation and ATen glue around
// the kernels of kernels.cu (declared in cuda_kernels.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "cuda_kernels.h"
#include "ops.h"

namespace fastdet {
namespace {

namespace K = fastdet::cuda;

K::DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return K::DType::kFloat;
    case at::kDouble: return K::DType::kDouble;
    case at::kHalf: return K::DType::kHalf;
    case at::kBFloat16: return K::DType::kBFloat16;
    default: TORCH_CHECK(false, "fastdet.ops.", op, " (CUDA): unsupported dtype ", t.scalar_type());
  }
}

void check_float32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "fastdet.ops.", op, " (CUDA): ", name,
              " must be float32 (the dispatch sends other dtypes to the torch reference), got ", t.scalar_type());
}

template <bool kGiou>
at::Tensor pairwise_cuda(const at::Tensor& a_in, const at::Tensor& b_in, double eps, const char* op) {
  check_pairwise(a_in, b_in, op);
  c10::cuda::CUDAGuard guard(a_in.device());
  const bool batched = a_in.dim() == 3;
  const at::Tensor a = (batched ? a_in : a_in.unsqueeze(0)).contiguous();
  const at::Tensor b = (batched ? b_in : b_in.unsqueeze(0)).contiguous();
  const int64_t B = a.size(0), N = a.size(1), M = b.size(1);
  at::Tensor out = at::empty({B, N, M}, a.options());
  K::pairwise(dtype_of(a, op), a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(), B, N, M, eps, kGiou,
              c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return batched ? out : out.squeeze(0);
}

at::Tensor box_iou_cuda(const at::Tensor& a, const at::Tensor& b, double eps) {
  return pairwise_cuda<false>(a, b, eps, "box_iou");
}

at::Tensor generalized_box_iou_cuda(const at::Tensor& a, const at::Tensor& b, double eps) {
  return pairwise_cuda<true>(a, b, eps, "generalized_box_iou");
}

at::Tensor giou_loss_cuda(const at::Tensor& pred_in, const at::Tensor& target_in, double eps) {
  check_paired(pred_in, target_in, "giou_loss");
  c10::cuda::CUDAGuard guard(pred_in.device());
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  auto sizes = pred.sizes().vec();
  sizes.pop_back();
  at::Tensor out = at::empty(sizes, pred.options());
  K::giou_loss(dtype_of(pred, "giou_loss"), pred.const_data_ptr(), target.const_data_ptr(), out.data_ptr(),
               out.numel(), eps, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> giou_loss_backward_cuda(const at::Tensor& grad_in, const at::Tensor& pred_in,
                                                           const at::Tensor& target_in, double eps) {
  check_paired(pred_in, target_in, "giou_loss_backward");
  c10::cuda::CUDAGuard guard(pred_in.device());
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.numel() / 4;
  TORCH_CHECK(grad_in.numel() == n, "fastdet.ops.giou_loss_backward: grad has ", grad_in.numel(),
              " elements, expected ", n);
  const at::Tensor grad = grad_in.to(pred.scalar_type()).contiguous();
  at::Tensor gp = at::empty_like(pred), gt = at::empty_like(target);
  K::giou_loss_backward(dtype_of(pred, "giou_loss_backward"), grad.const_data_ptr(), pred.const_data_ptr(),
                        target.const_data_ptr(), gp.data_ptr(), gt.data_ptr(), n, eps,
                        c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gp, gt};
}

void ema_update_cuda(at::TensorList ema, at::TensorList src, const at::Tensor& decay_in) {
  check_ema(ema, src, decay_in);
  if (ema.empty()) return;
  c10::cuda::CUDAGuard guard(decay_in.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool dbl = decay_in.scalar_type() == at::kDouble;
  const at::Tensor decay = dbl ? decay_in.contiguous() : decay_in.to(at::kFloat).contiguous();
  std::vector<K::EmaJob> f32, f64, f16, bf16, bytes;
  for (size_t i = 0; i < ema.size(); ++i) {
    const at::Tensor& e = ema[i];
    const at::Tensor& s = src[i];
    // Contiguous and channels-last alike: both are flat arrays in the same element order.
    const bool dense = same_dense_layout(e, s) && e.scalar_type() == s.scalar_type();
    if (!e.is_floating_point()) {
      if (dense) {
        bytes.push_back({e.data_ptr(), s.const_data_ptr(), e.numel() * static_cast<int64_t>(e.element_size())});
      } else {
        at::Tensor(e).copy_(s);
      }
      continue;
    }
    if (!dense) {
      // Rare layouts go through ATen (still no host sync: the weight stays on the device).
      at::Tensor(e).lerp_(s.to(e.scalar_type()), (1 - decay).to(e.scalar_type()));
      continue;
    }
    const K::EmaJob job{e.data_ptr(), s.const_data_ptr(), e.numel()};
    switch (e.scalar_type()) {
      case at::kFloat: f32.push_back(job); break;
      case at::kDouble: f64.push_back(job); break;
      case at::kHalf: f16.push_back(job); break;
      case at::kBFloat16: bf16.push_back(job); break;
      default: at::Tensor(e).lerp_(s, (1 - decay).to(e.scalar_type()));
    }
  }
  const void* d = decay.const_data_ptr();
  if (!f32.empty()) K::ema_lerp(K::DType::kFloat, f32.data(), f32.size(), d, dbl, stream);
  if (!f64.empty()) K::ema_lerp(K::DType::kDouble, f64.data(), f64.size(), d, dbl, stream);
  if (!f16.empty()) K::ema_lerp(K::DType::kHalf, f16.data(), f16.size(), d, dbl, stream);
  if (!bf16.empty()) K::ema_lerp(K::DType::kBFloat16, bf16.data(), bf16.size(), d, dbl, stream);
  if (!bytes.empty()) K::ema_copy(bytes.data(), bytes.size(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct AssignBuffers {
  at::Tensor count, owner, assigned, value, max_metric, max_iou;
  AssignBuffers(int64_t B, int64_t M, int64_t A, const at::TensorOptions& f) {
    const auto i = f.dtype(at::kInt);
    count = at::zeros({B, A}, i);
    owner = at::empty({B, A}, i);
    assigned = at::empty({B, A}, i);
    value = at::empty({B, A}, f);
    max_metric = at::zeros({B, M}, f);
    max_iou = at::zeros({B, M}, f);
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_outputs(int64_t B, int64_t A, int64_t C, int64_t M,
                                                             int64_t bg_index, const at::TensorOptions& f) {
  at::Tensor labels = at::empty({B, A}, f.dtype(at::kLong));
  at::Tensor bboxes = at::empty({B, A, 4}, f);
  at::Tensor scores = at::empty({B, A, C}, f);
  if (M == 0) {
    labels.fill_(bg_index);
    bboxes.zero_();
    scores.zero_();
  }
  return {labels, bboxes, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> task_aligned_assign_cuda(
    const at::Tensor& pred_scores, const at::Tensor& pred_bboxes, const at::Tensor& anchor_points,
    const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask, int64_t bg_index,
    int64_t topk, double alpha, double beta, double eps) {
  const char* op = "task_aligned_assign";
  TORCH_CHECK(pred_scores.dim() == 3, "fastdet.ops.", op, ": pred_scores must be [B, A, C], got ", pred_scores.sizes());
  check_float32(pred_scores, op, "pred_scores");
  c10::cuda::CUDAGuard guard(pred_scores.device());
  const int64_t B = pred_scores.size(0), A = pred_scores.size(1), C = pred_scores.size(2);
  TORCH_CHECK(pred_bboxes.sizes() == at::IntArrayRef({B, A, 4}), "fastdet.ops.", op,
              ": pred_bboxes must be [B, A, 4], got ", pred_bboxes.sizes());
  TORCH_CHECK(anchor_points.sizes() == at::IntArrayRef({A, 2}), "fastdet.ops.", op,
              ": anchor_points must be [A, 2], got ", anchor_points.sizes());
  TORCH_CHECK(gt_bboxes.dim() == 3 && gt_bboxes.size(0) == B && gt_bboxes.size(2) == 4, "fastdet.ops.", op,
              ": gt_bboxes must be [B, M, 4], got ", gt_bboxes.sizes());
  const int64_t M = gt_bboxes.size(1);
  TORCH_CHECK(gt_labels.numel() == B * M && pad_gt_mask.numel() == B * M, "fastdet.ops.", op,
              ": gt_labels and pad_gt_mask must be [B, M, 1]");
  const int64_t k = std::min(topk, A);
  TORCH_CHECK(topk >= 1 && k <= K::kMaxTopk, "fastdet.ops.", op, " (CUDA): topk must be in [1, ", K::kMaxTopk,
              "], got ", topk);
  const auto f = pred_scores.options();
  auto [labels, bboxes, scores] = empty_outputs(B, A, C, M, bg_index, f);
  if (B * A == 0 || M == 0) return {labels, bboxes, scores};
  const at::Tensor S = pred_scores.contiguous(), P = pred_bboxes.to(at::kFloat).contiguous();
  const at::Tensor pts = anchor_points.to(at::kFloat).contiguous(), G = gt_bboxes.to(at::kFloat).contiguous();
  const at::Tensor Lb = gt_labels.to(at::kLong).contiguous(), Vm = pad_gt_mask.to(at::kFloat).contiguous();
  AssignBuffers buf(B, M, A, f);
  const K::GtView gt{G.const_data_ptr<float>(), Lb.const_data_ptr<int64_t>(), Vm.const_data_ptr<float>(), M};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  K::tal_candidates(S.const_data_ptr<float>(), P.const_data_ptr<float>(), pts.const_data_ptr<float>(), gt, B, A, C,
                    static_cast<int>(k), fa, fb, buf.count.data_ptr<int32_t>(), buf.owner.data_ptr<int32_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  K::resolve(true, S.const_data_ptr<float>(), P.const_data_ptr<float>(), nullptr, gt, B, A, C, fa, fb, bg_index,
             buf.count.const_data_ptr<int32_t>(), buf.owner.const_data_ptr<int32_t>(), buf.assigned.data_ptr<int32_t>(),
             buf.value.data_ptr<float>(), buf.max_metric.data_ptr<float>(), buf.max_iou.data_ptr<float>(),
             labels.data_ptr<int64_t>(), bboxes.data_ptr<float>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  K::write_scores(true, gt, B, A, C, bg_index, static_cast<float>(eps), buf.assigned.const_data_ptr<int32_t>(),
                  buf.value.const_data_ptr<float>(), buf.max_metric.const_data_ptr<float>(),
                  buf.max_iou.const_data_ptr<float>(), scores.data_ptr<float>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {labels, bboxes, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> atss_assign_cuda(
    const at::Tensor& anchors, c10::IntArrayRef num_anchors_list, const at::Tensor& gt_labels,
    const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask, const std::optional<at::Tensor>& pred_bboxes,
    int64_t bg_index, int64_t num_classes, int64_t topk, double /*eps*/) {
  const char* op = "atss_assign";
  TORCH_CHECK(anchors.dim() == 2 && anchors.size(1) == 4, "fastdet.ops.", op, ": anchors must be [A, 4], got ",
              anchors.sizes());
  TORCH_CHECK(gt_bboxes.dim() == 3 && gt_bboxes.size(2) == 4, "fastdet.ops.", op,
              ": gt_bboxes must be [B, M, 4], got ", gt_bboxes.sizes());
  check_float32(gt_bboxes, op, "gt_bboxes");
  c10::cuda::CUDAGuard guard(gt_bboxes.device());
  const int64_t A = anchors.size(0), B = gt_bboxes.size(0), M = gt_bboxes.size(1);
  TORCH_CHECK(gt_labels.numel() == B * M && pad_gt_mask.numel() == B * M, "fastdet.ops.", op,
              ": gt_labels and pad_gt_mask must be [B, M, 1]");
  const int n_levels = static_cast<int>(num_anchors_list.size());
  TORCH_CHECK(n_levels >= 1 && n_levels <= K::kMaxLevels, "fastdet.ops.", op, " (CUDA): 1 to ", K::kMaxLevels,
              " levels, got ", n_levels);
  TORCH_CHECK(topk >= 1 && topk <= K::kMaxTopk, "fastdet.ops.", op, " (CUDA): topk must be in [1, ", K::kMaxTopk,
              "], got ", topk);
  int64_t total = 0, Kc = 0;
  for (int64_t n : num_anchors_list) {
    TORCH_CHECK(n >= 1, "fastdet.ops.", op, ": every level needs at least one anchor, got ", num_anchors_list);
    total += n;
    Kc += std::min<int64_t>(topk, n);
  }
  TORCH_CHECK(total == A, "fastdet.ops.", op, ": num_anchors_list sums to ", total, ", anchors has ", A, " rows");
  const auto f = gt_bboxes.options();
  auto [labels, bboxes, scores] = empty_outputs(B, A, num_classes, M, bg_index, f);
  if (B * A == 0 || M == 0) return {labels, bboxes, scores};
  const at::Tensor AN = anchors.to(at::kFloat).contiguous(), G = gt_bboxes.contiguous();
  const at::Tensor centers = ((AN.slice(1, 0, 2) + AN.slice(1, 2, 4)) / 2).contiguous();  // [A, 2]
  const at::Tensor Lb = gt_labels.to(at::kLong).contiguous(), Vm = pad_gt_mask.to(at::kFloat).contiguous();
  at::Tensor P;
  if (pred_bboxes.has_value()) {
    TORCH_CHECK(pred_bboxes->sizes() == at::IntArrayRef({B, A, 4}), "fastdet.ops.", op,
                ": pred_bboxes must be [B, A, 4], got ", pred_bboxes->sizes());
    P = pred_bboxes->to(at::kFloat).contiguous();
  }
  AssignBuffers buf(B, M, A, f);
  const K::GtView gt{G.const_data_ptr<float>(), Lb.const_data_ptr<int64_t>(), Vm.const_data_ptr<float>(), M};
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor cand = at::zeros({B, M, Kc}, f.dtype(at::kLong));
  at::Tensor cand_iou = at::zeros({B, M, Kc}, f);
  K::atss_candidates(AN.const_data_ptr<float>(), centers.const_data_ptr<float>(), gt, B, num_anchors_list.data(),
                     n_levels, static_cast<int>(topk), Kc, cand.data_ptr<int64_t>(), cand_iou.data_ptr<float>(),
                     stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The threshold (mean + unbiased std of the candidates' IoUs) with the reference's own
  // ATen reductions, so that it agrees to the bit: an IoU equal to the threshold is common.
  const at::Tensor thr = (cand_iou.mean(-1) + cand_iou.std(-1)).contiguous();  // [B, M]
  K::atss_claim(centers.const_data_ptr<float>(), gt, B, A, Kc, cand.const_data_ptr<int64_t>(),
                cand_iou.const_data_ptr<float>(), thr.const_data_ptr<float>(), buf.count.data_ptr<int32_t>(),
                buf.owner.data_ptr<int32_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const float* Pp = pred_bboxes.has_value() ? P.const_data_ptr<float>() : nullptr;
  K::resolve(false, nullptr, Pp, AN.const_data_ptr<float>(), gt, B, A, num_classes, 0.0f, 0.0f, bg_index,
             buf.count.const_data_ptr<int32_t>(), buf.owner.const_data_ptr<int32_t>(), buf.assigned.data_ptr<int32_t>(),
             buf.value.data_ptr<float>(), buf.max_metric.data_ptr<float>(), buf.max_iou.data_ptr<float>(),
             labels.data_ptr<int64_t>(), bboxes.data_ptr<float>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  K::write_scores(false, gt, B, A, num_classes, bg_index, 0.0f, buf.assigned.const_data_ptr<int32_t>(),
                  buf.value.const_data_ptr<float>(), buf.max_metric.const_data_ptr<float>(),
                  buf.max_iou.const_data_ptr<float>(), scores.data_ptr<float>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {labels, bboxes, scores};
}

std::tuple<at::Tensor, at::Tensor> simota_assign_cuda(const at::Tensor& pred_scores, const at::Tensor& pred_boxes,
                                                      const at::Tensor& anchor_points, const at::Tensor& strides,
                                                      const at::Tensor& gt_boxes, const at::Tensor& gt_labels,
                                                      const at::Tensor& gt_mask, double center_radius, int64_t topk,
                                                      double iou_weight) {
  const char* op = "simota_assign";
  const auto dims = check_simota(pred_scores, pred_boxes, anchor_points, strides, gt_boxes, gt_labels, gt_mask, topk, op);
  check_float32(pred_scores, op, "pred_scores");
  c10::cuda::CUDAGuard guard(pred_scores.device());
  const int64_t B = dims[0], A = dims[1], C = dims[2], M = dims[3];
  TORCH_CHECK(A < (int64_t{1} << 30), "fastdet.ops.", op, " (CUDA): at most 2^30 points, got ", A);
  const auto f = pred_scores.options();
  at::Tensor out_gt = at::full({B, A}, -1, f.dtype(at::kLong));
  at::Tensor out_iou = at::zeros({B, A}, f);
  if (B * A == 0 || M == 0 || C == 0) return {out_gt, out_iou};
  const at::Tensor S = pred_scores.contiguous(), P = pred_boxes.to(at::kFloat).contiguous();
  const at::Tensor pts = anchor_points.to(at::kFloat).contiguous(), st = strides.to(at::kFloat).contiguous();
  const at::Tensor G = gt_boxes.to(at::kFloat).contiguous(), L = gt_labels.to(at::kLong).contiguous();
  const at::Tensor V = gt_mask.to(at::kBool).contiguous();
  at::Tensor cand = at::empty({B, A}, f.dtype(at::kByte));
  at::Tensor neg_sum = at::empty({B, A}, f);
  at::Tensor count = at::zeros({B, A}, f.dtype(at::kInt));
  at::Tensor owner = at::empty({B, A}, f.dtype(at::kInt));
  K::simota(S.const_data_ptr<float>(), P.const_data_ptr<float>(), pts.const_data_ptr<float>(),
            st.const_data_ptr<float>(), G.const_data_ptr<float>(), L.const_data_ptr<int64_t>(),
            V.const_data_ptr<bool>(), B, A, C, M, static_cast<float>(center_radius), static_cast<float>(iou_weight),
            static_cast<int>(std::min<int64_t>(topk, A)), cand.data_ptr<uint8_t>(), neg_sum.data_ptr<float>(),
            count.data_ptr<int32_t>(), owner.data_ptr<int32_t>(), out_gt.data_ptr<int64_t>(), out_iou.data_ptr<float>(),
            c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_gt, out_iou};
}

}  // namespace
}  // namespace fastdet

TORCH_LIBRARY_IMPL(fastdet, CUDA, m) {
  m.impl("box_iou", &fastdet::box_iou_cuda);
  m.impl("generalized_box_iou", &fastdet::generalized_box_iou_cuda);
  m.impl("giou_loss", &fastdet::giou_loss_cuda);
  m.impl("giou_loss_backward", &fastdet::giou_loss_backward_cuda);
  m.impl("ema_update_", &fastdet::ema_update_cuda);
  m.impl("task_aligned_assign", &fastdet::task_aligned_assign_cuda);
  m.impl("atss_assign", &fastdet::atss_assign_cuda);
  m.impl("yolo_targets", &fastdet::yolo_targets_cuda);
  m.impl("simota_assign", &fastdet::simota_assign_cuda);
}
