// CUDA entry of fastdet.ops.yolo_targets: checks, allocation and the two launches of
// yolo_targets.cu. The argument checks and the geometry are shared with the CPU kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "ops.h"
#include "yolo_targets_cuda.h"

namespace fastdet {

std::vector<at::Tensor> yolo_targets_cuda(const at::Tensor& gt_boxes_in, const at::Tensor& gt_labels_in,
                                          const at::Tensor& gt_mask_in, const at::Tensor& gt_scores_in,
                                          c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level,
                                          c10::IntArrayRef anchor_slot, c10::IntArrayRef strides, int64_t img_h,
                                          int64_t img_w, int64_t num_classes) {
  check_yolo_inputs(gt_boxes_in, gt_labels_in, gt_mask_in, gt_scores_in);
  const YoloSpec s = make_yolo_spec(anchors, anchor_level, anchor_slot, strides, img_h, img_w, num_classes);
  c10::cuda::CUDAGuard guard(gt_boxes_in.device());
  const at::Tensor boxes = gt_boxes_in.contiguous(), labels = gt_labels_in.contiguous();
  const at::Tensor mask = gt_mask_in.contiguous(), scores = gt_scores_in.contiguous();
  const int64_t B = boxes.size(0), M = boxes.size(1);
  std::vector<at::Tensor> out = yolo_outputs(s, B, boxes.options());
  if (B * M == 0) return out;
  TORCH_CHECK(M < (int64_t(1) << 31), "fastdet.ops.yolo_targets: too many boxes per image (", M, ")");
  std::vector<at::Tensor> winner;
  YoloOut o{};
  for (int l = 0; l < s.n_levels; ++l) {
    winner.push_back(at::full({B * s.slots[l] * s.grid_h[l] * s.grid_w[l]}, -1, boxes.options().dtype(at::kInt)));
    o.out[l] = out[l].data_ptr<float>();
    o.winner[l] = winner.back().data_ptr<int32_t>();
  }
  const YoloView v{boxes.const_data_ptr<float>(), labels.const_data_ptr<int64_t>(), mask.const_data_ptr<bool>(),
                   scores.const_data_ptr<float>()};
  cuda::yolo_targets(s, v, B, M, o, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace fastdet
