// YOLOv3 grid targets (PaddleDetection Gt2YoloTarget) for one box, shared by the CPU
// (yolo_targets_cpu.cpp) and CUDA (yolo_targets.cu) kernels.
//
// Every float operation follows fastdet/ops/yolo.py's reference term by term, rounded
// once per operation (the yt_* helpers stop nvcc from fusing a*b+c into an FMA), so all
// back ends pick the same anchor and cell for every box; only logf may differ by an ulp.
#pragma once

#include <cmath>
#include <cstdint>

#include "box_math.h"

namespace fastdet {

constexpr int kYoloMaxLevels = 8;
constexpr int kYoloMaxAnchors = 32;

// The constant geometry of one call (passed to CUDA kernels by value).
struct YoloSpec {
  int n_levels;
  int K;                               // anchors
  int64_t C;                           // classes
  float img_h, img_w;                  // input size, px
  float anchor_w[kYoloMaxAnchors];     // px
  float anchor_h[kYoloMaxAnchors];
  int anchor_level[kYoloMaxAnchors];   // level whose mask holds the anchor, -1 if none
  int anchor_slot[kYoloMaxAnchors];    // its index in that mask
  int64_t grid_h[kYoloMaxLevels];      // int(img_h / stride)
  int64_t grid_w[kYoloMaxLevels];
  int64_t slots[kYoloMaxLevels];       // anchors in the level's mask
};

// Where one box lands: level, flat cell (slot * gh * gw + gj * gw + gi) and its 6 values
// (tx, ty, tw, th, tscale, tobj).
struct YoloHit {
  int level;
  int64_t cell;
  float v[6];
};

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float yt_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float yt_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float yt_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float yt_div(float a, float b) { return __fdiv_rn(a, b); }
#else
inline float yt_add(float a, float b) { return a + b; }
inline float yt_sub(float a, float b) { return a - b; }
inline float yt_mul(float a, float b) { return a * b; }
inline float yt_div(float a, float b) { return a / b; }
#endif

// False when the box is skipped: padded, no area, a score <= 0, or its best anchor is in
// no level's mask. The best anchor is the first with the highest shape-only IoU
// (anchor and box both at the origin, sizes normalised by the image).
FD_HD bool yolo_hit(const YoloSpec& s, float x1, float y1, float x2, float y2, float score, bool valid,
                    YoloHit* hit) {
  const float gw = yt_div(yt_sub(x2, x1), s.img_w);
  const float gh = yt_div(yt_sub(y2, y1), s.img_h);
  if (!valid || !(gw > 0.0f) || !(gh > 0.0f) || !(score > 0.0f)) return false;
  const float cx = yt_div(yt_mul(yt_add(x1, x2), 0.5f), s.img_w);
  const float cy = yt_div(yt_mul(yt_add(y1, y2), 0.5f), s.img_h);
  int best = -1;
  float best_iou = 0.0f;
  for (int k = 0; k < s.K; ++k) {
    const float aw = yt_div(s.anchor_w[k], s.img_w), ah = yt_div(s.anchor_h[k], s.img_h);
    const float inter = yt_mul(min_(gw, aw), min_(gh, ah));
    const float iou = yt_div(inter, yt_sub(yt_add(yt_mul(gw, gh), yt_mul(aw, ah)), inter));
    if (iou > best_iou) {
      best_iou = iou;
      best = k;
    }
  }
  if (best < 0 || s.anchor_level[best] < 0) return false;
  const int l = s.anchor_level[best];
  const int64_t nw = s.grid_w[l], nh = s.grid_h[l];
  const float gx = yt_mul(cx, static_cast<float>(nw)), gy = yt_mul(cy, static_cast<float>(nh));
  // Truncation as Paddle's int(); clamped so a centre on the far edge stays on the grid.
  const int64_t gi = min_<int64_t>(max_<int64_t>(static_cast<int64_t>(gx), 0), nw - 1);
  const int64_t gj = min_<int64_t>(max_<int64_t>(static_cast<int64_t>(gy), 0), nh - 1);
  hit->level = l;
  hit->cell = (s.anchor_slot[best] * nh + gj) * nw + gi;
  hit->v[0] = yt_sub(gx, static_cast<float>(gi));
  hit->v[1] = yt_sub(gy, static_cast<float>(gj));
  hit->v[2] = logf(yt_div(yt_mul(gw, s.img_w), s.anchor_w[best]));
  hit->v[3] = logf(yt_div(yt_mul(gh, s.img_h), s.anchor_h[best]));
  hit->v[4] = yt_sub(2.0f, yt_mul(gw, gh));
  hit->v[5] = score;
  return true;
}

}  // namespace fastdet

namespace fastdet {

// The device side of one call: inputs [B, M(, 4)], and per level the output
// [B, slots, 6 + C, gh, gw] (zeroed) and the winner buffer [B, slots * gh * gw] (-1).
struct YoloView {
  const float* boxes;
  const int64_t* labels;
  const bool* mask;
  const float* scores;
};
struct YoloOut {
  float* out[kYoloMaxLevels];
  int32_t* winner[kYoloMaxLevels];
};

}  // namespace fastdet

#if !defined(__CUDACC__)
#include <ATen/core/Tensor.h>

#include <vector>

namespace fastdet {
// Host helpers shared by the CPU and CUDA entries (yolo_targets_cpu.cpp): the geometry of
// a call, the input checks, and the zeroed per-level outputs.
YoloSpec make_yolo_spec(c10::ArrayRef<double> anchors, c10::IntArrayRef anchor_level, c10::IntArrayRef anchor_slot,
                        c10::IntArrayRef strides, int64_t img_h, int64_t img_w, int64_t num_classes);
void check_yolo_inputs(const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                       const at::Tensor& gt_scores);
std::vector<at::Tensor> yolo_outputs(const YoloSpec& s, int64_t B, const at::TensorOptions& f);
}  // namespace fastdet
#endif
