// CPU kernel of fastdet.ops.yolo_targets: PaddleDetection's Gt2YoloTarget loop over the
// padded boxes of each image, images in parallel. Boxes are visited in order, so when two
// land on the same anchor and cell the later one's values stay (and both class channels
// are 1), exactly as in Paddle's loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "yolo_targets.h"

namespace fastdet {

YoloSpec make_yolo_spec(c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level, c10::IntArrayRef anchor_slot,
                        c10::IntArrayRef strides, int64_t img_h, int64_t img_w, int64_t num_classes) {
  const char* op = "fastdet.ops.yolo_targets";
  const int64_t K = static_cast<int64_t>(anchor_level.size());
  const int64_t L = static_cast<int64_t>(strides.size());
  TORCH_CHECK(K >= 1 && K <= kYoloMaxAnchors, op, ": 1 to ", kYoloMaxAnchors, " anchors, got ", K);
  TORCH_CHECK(L >= 1 && L <= kYoloMaxLevels, op, ": 1 to ", kYoloMaxLevels, " levels, got ", L);
  TORCH_CHECK(static_cast<int64_t>(anchors.size()) == 2 * K && static_cast<int64_t>(anchor_slot.size()) == K, op,
              ": anchors (w, h pairs), anchor_level and anchor_slot must describe the same ", K, " anchors");
  TORCH_CHECK(num_classes >= 1, op, ": num_classes must be positive, got ", num_classes);
  TORCH_CHECK(img_h > 0 && img_w > 0, op, ": image size must be positive, got ", img_h, "x", img_w);
  YoloSpec s{};
  s.n_levels = static_cast<int>(L);
  s.K = static_cast<int>(K);
  s.C = num_classes;
  s.img_h = static_cast<float>(img_h);
  s.img_w = static_cast<float>(img_w);
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(strides[l] > 0, op, ": strides must be positive, got ", strides);
    s.grid_h[l] = img_h / strides[l];
    s.grid_w[l] = img_w / strides[l];
    s.slots[l] = 0;
  }
  for (int64_t k = 0; k < K; ++k) {
    s.anchor_w[k] = static_cast<float>(anchors[2 * k]);
    s.anchor_h[k] = static_cast<float>(anchors[2 * k + 1]);
    TORCH_CHECK(s.anchor_w[k] > 0 && s.anchor_h[k] > 0, op, ": anchor ", k, " has no area");
    TORCH_CHECK(anchor_level[k] >= -1 && anchor_level[k] < L, op, ": anchor_level ", anchor_level[k],
                " is not a level");
    s.anchor_level[k] = static_cast<int>(anchor_level[k]);
    s.anchor_slot[k] = static_cast<int>(anchor_slot[k]);
    if (anchor_level[k] >= 0) ++s.slots[anchor_level[k]];
  }
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(s.anchor_level[k] < 0 || (s.anchor_slot[k] >= 0 && s.anchor_slot[k] < s.slots[s.anchor_level[k]]),
                op, ": anchor_slot ", s.anchor_slot[k], " of anchor ", k, " is outside its mask");
  }
  return s;
}

void check_yolo_inputs(const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                       const at::Tensor& gt_scores) {
  const char* op = "fastdet.ops.yolo_targets";
  TORCH_CHECK(gt_boxes.dim() == 3 && gt_boxes.size(2) == 4, op, ": gt_boxes must be [B, M, 4], got ",
              gt_boxes.sizes());
  TORCH_CHECK(gt_boxes.scalar_type() == at::kFloat, op, ": gt_boxes must be float32, got ", gt_boxes.scalar_type());
  const auto BM = gt_boxes.sizes().slice(0, 2);
  TORCH_CHECK(gt_labels.sizes() == BM && gt_mask.sizes() == BM && gt_scores.sizes() == BM, op,
              ": gt_labels, gt_mask and gt_scores must be [B, M] = ", BM, ", got ", gt_labels.sizes(), ", ",
              gt_mask.sizes(), " and ", gt_scores.sizes());
  TORCH_CHECK(gt_labels.scalar_type() == at::kLong && gt_mask.scalar_type() == at::kBool &&
                  gt_scores.scalar_type() == at::kFloat,
              op, ": gt_labels must be int64, gt_mask bool and gt_scores float32");
  TORCH_CHECK(gt_labels.device() == gt_boxes.device() && gt_mask.device() == gt_boxes.device() &&
                  gt_scores.device() == gt_boxes.device(),
              op, ": all inputs must be on one device");
}

std::vector<at::Tensor> yolo_outputs(const YoloSpec& s, int64_t B, const at::TensorOptions& f) {
  std::vector<at::Tensor> out;
  for (int l = 0; l < s.n_levels; ++l) out.push_back(at::zeros({B, s.slots[l], 6 + s.C, s.grid_h[l], s.grid_w[l]}, f));
  return out;
}

std::vector<at::Tensor> yolo_targets_cpu(const at::Tensor& gt_boxes_in, const at::Tensor& gt_labels_in,
                                         const at::Tensor& gt_mask_in, const at::Tensor& gt_scores_in,
                                         c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level,
                                         c10::IntArrayRef anchor_slot, c10::IntArrayRef strides, int64_t img_h,
                                         int64_t img_w, int64_t num_classes) {
  check_yolo_inputs(gt_boxes_in, gt_labels_in, gt_mask_in, gt_scores_in);
  const YoloSpec s = make_yolo_spec(anchors, anchor_level, anchor_slot, strides, img_h, img_w, num_classes);
  const at::Tensor boxes = gt_boxes_in.contiguous(), labels = gt_labels_in.contiguous();
  const at::Tensor mask = gt_mask_in.contiguous(), scores = gt_scores_in.contiguous();
  const int64_t B = boxes.size(0), M = boxes.size(1), C = s.C;
  std::vector<at::Tensor> out = yolo_outputs(s, B, boxes.options());
  std::vector<float*> ptr;
  for (auto& t : out) ptr.push_back(t.data_ptr<float>());
  const float* bx = boxes.const_data_ptr<float>();
  const int64_t* lb = labels.const_data_ptr<int64_t>();
  const bool* mk = mask.const_data_ptr<bool>();
  const float* sc = scores.const_data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m = 0; m < M; ++m) {
        const int64_t i = b * M + m;
        const float* g = bx + 4 * i;
        YoloHit hit;
        if (!yolo_hit(s, g[0], g[1], g[2], g[3], sc[i], mk[i], &hit)) continue;
        const int64_t hw = s.grid_h[hit.level] * s.grid_w[hit.level];
        const int64_t slot = hit.cell / hw, pix = hit.cell % hw;
        float* t = ptr[hit.level] + (b * s.slots[hit.level] + slot) * (6 + C) * hw + pix;  // channel 0
        for (int c = 0; c < 6; ++c) t[c * hw] = hit.v[c];
        const int64_t label = min_<int64_t>(max_<int64_t>(lb[i], 0), C - 1);
        t[(6 + label) * hw] = 1.0f;
      }
    }
  });
  return out;
}

}  // namespace fastdet
