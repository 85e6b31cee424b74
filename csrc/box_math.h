// Box arithmetic shared by the CPU (C++) and CUDA kernels of fastdet.ops.
//
// Every formula here follows fastdet/ops/reference.py term by term (same operations in
// the same order), so a kernel and its reference agree to the last bit or two in fp32.
// Boxes are xyxy; T is the accumulation type (float for half/bfloat16 inputs).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FD_HD __host__ __device__ __forceinline__
#else
#define FD_HD inline
#endif

// CPU hot loops are compiled twice, for AVX2 and for the x86-64 baseline, and the loader
// picks one at run time (GCC function multi-versioning), so the cached build still runs
// on any x86-64 machine. AVX2 without FMA: every lane rounds as the scalar code does.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define FD_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FD_CPU_CLONES
#endif

namespace fastdet {

template <typename T>
FD_HD T max_(T a, T b) {
  return a > b ? a : b;
}

template <typename T>
FD_HD T min_(T a, T b) {
  return a < b ? a : b;
}

// Area with each side clamped at zero, like reference._pairwise_inter_union.
template <typename T>
FD_HD T clamped_area(T x1, T y1, T x2, T y2) {
  return max_(x2 - x1, T(0)) * max_(y2 - y1, T(0));
}

// Intersection area of two boxes (sides clamped at zero).
template <typename T>
FD_HD T intersection(T ax1, T ay1, T ax2, T ay2, T bx1, T by1, T bx2, T by2) {
  const T w = max_(min_(ax2, bx2) - max_(ax1, bx1), T(0));
  const T h = max_(min_(ay2, by2) - max_(ay1, by1), T(0));
  return w * h;
}

// reference.box_iou for one pair: inter / max(union, eps).
template <typename T>
FD_HD T pair_iou(T ax1, T ay1, T ax2, T ay2, T area_a, T bx1, T by1, T bx2, T by2, T area_b,
                 T eps) {
  const T inter = intersection(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2);
  const T uni = area_a + area_b - inter;
  return inter / max_(uni, eps);
}

// reference.generalized_box_iou for one pair.
template <typename T>
FD_HD T pair_giou(T ax1, T ay1, T ax2, T ay2, T area_a, T bx1, T by1, T bx2, T by2, T area_b,
                  T eps) {
  const T inter = intersection(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2);
  const T uni = area_a + area_b - inter;
  const T iou = inter / max_(uni, eps);
  const T ew = max_(max_(ax2, bx2) - min_(ax1, bx1), T(0));
  const T eh = max_(max_(ay2, by2) - min_(ay1, by1), T(0));
  const T enclose = ew * eh;
  return iou - (enclose - uni) / max_(enclose, eps);
}

// reference.giou_loss for one pair of boxes p (prediction) and t (target):
// 1 - GIoU without clamping the box areas (PaddleDetection GIoULoss).
template <typename T>
FD_HD T giou_loss_fwd(const T* p, const T* t, T eps) {
  const T x1 = max_(p[0], t[0]);
  const T y1 = max_(p[1], t[1]);
  const T x2 = min_(p[2], t[2]);
  const T y2 = min_(p[3], t[3]);
  const T inter = max_(x2 - x1, T(0)) * max_(y2 - y1, T(0));
  const T area_p = (p[2] - p[0]) * (p[3] - p[1]);
  const T area_t = (t[2] - t[0]) * (t[3] - t[1]);
  const T uni = area_p + area_t - inter + eps;
  const T iou = inter / uni;
  const T enclose = (max_(p[2], t[2]) - min_(p[0], t[0])) * (max_(p[3], t[3]) - min_(p[1], t[1])) + eps;
  return T(1) - (iou - (enclose - uni) / enclose);
}

// d max(a, b) / da as autograd defines it: 1, 0, or 1/2 on a tie.
template <typename T>
FD_HD T dmax_da(T a, T b) {
  return a > b ? T(1) : (a < b ? T(0) : T(0.5));
}

// d min(a, b) / da likewise.
template <typename T>
FD_HD T dmin_da(T a, T b) {
  return a < b ? T(1) : (a > b ? T(0) : T(0.5));
}

// Backward of giou_loss_fwd: g is dL/dloss; writes dL/dp[0..3] and dL/dt[0..3].
// It is the chain rule of the forward above with torch's subgradient conventions
// (clamp passes the gradient only where its input is > 0; max/min split ties evenly),
// so it equals autograd through the reference.
template <typename T>
FD_HD void giou_loss_bwd(const T* p, const T* t, T eps, T g, T* gp, T* gt) {
  const T x1 = max_(p[0], t[0]);
  const T y1 = max_(p[1], t[1]);
  const T x2 = min_(p[2], t[2]);
  const T y2 = min_(p[3], t[3]);
  const T iw_raw = x2 - x1;
  const T ih_raw = y2 - y1;
  const T iw = max_(iw_raw, T(0));
  const T ih = max_(ih_raw, T(0));
  const T inter = iw * ih;
  const T pw = p[2] - p[0], ph = p[3] - p[1];
  const T tw = t[2] - t[0], th = t[3] - t[1];
  const T uni = pw * ph + tw * th - inter + eps;
  const T ex1 = min_(p[0], t[0]), ey1 = min_(p[1], t[1]);
  const T ex2 = max_(p[2], t[2]), ey2 = max_(p[3], t[3]);
  const T ew = ex2 - ex1, eh = ey2 - ey1;
  const T enclose = ew * eh + eps;

  // loss = 1 - inter/uni + (enclose - uni)/enclose
  const T g_inter_direct = -g / uni;
  const T g_uni = g * inter / (uni * uni) - g / enclose;
  const T g_enclose = g * uni / (enclose * enclose);
  const T g_inter = g_inter_direct - g_uni;  // uni = ... - inter
  const T g_area_p = g_uni, g_area_t = g_uni;

  const T g_iw = iw_raw > T(0) ? g_inter * ih : T(0);
  const T g_ih = ih_raw > T(0) ? g_inter * iw : T(0);
  const T g_ew = g_enclose * eh, g_eh = g_enclose * ew;

  // inter: x2 = min(p2, t2) enters +, x1 = max(p0, t0) enters -; enclose: ex2 +, ex1 -.
  gp[0] = -g_iw * dmax_da(p[0], t[0]) - g_ew * dmin_da(p[0], t[0]) - g_area_p * ph;
  gt[0] = -g_iw * dmax_da(t[0], p[0]) - g_ew * dmin_da(t[0], p[0]) - g_area_t * th;
  gp[1] = -g_ih * dmax_da(p[1], t[1]) - g_eh * dmin_da(p[1], t[1]) - g_area_p * pw;
  gt[1] = -g_ih * dmax_da(t[1], p[1]) - g_eh * dmin_da(t[1], p[1]) - g_area_t * tw;
  gp[2] = g_iw * dmin_da(p[2], t[2]) + g_ew * dmax_da(p[2], t[2]) + g_area_p * ph;
  gt[2] = g_iw * dmin_da(t[2], p[2]) + g_ew * dmax_da(t[2], p[2]) + g_area_t * th;
  gp[3] = g_ih * dmin_da(p[3], t[3]) + g_eh * dmax_da(p[3], t[3]) + g_area_p * pw;
  gt[3] = g_ih * dmin_da(t[3], p[3]) + g_eh * dmax_da(t[3], p[3]) + g_area_t * tw;
}

// torch.lerp(e, s, w) for a scalar weight, with torch's two-sided formula.
template <typename T>
FD_HD T lerp_(T e, T s, T w) {
  const T aw = w < T(0) ? -w : w;
  return aw < T(0.5) ? e + w * (s - e) : s - (s - e) * (T(1) - w);
}

}  // namespace fastdet

namespace fastdet {

// fastdet.ops.assigners.pairwise_iou for one pair (Paddle's iou_similarity):
// overlap / (area_a + area_b - overlap + eps), areas clamped at zero.
template <typename T>
FD_HD T paddle_iou(T ax1, T ay1, T ax2, T ay2, T bx1, T by1, T bx2, T by2, T eps) {
  const T overlap = intersection(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2);
  const T area_a = clamped_area(ax1, ay1, ax2, ay2);
  const T area_b = clamped_area(bx1, by1, bx2, by2);
  return overlap / (area_a + area_b - overlap + eps);
}

// fastdet.ops.assigners.points_inside_boxes for one point: min(l, t, r, b) > eps.
template <typename T>
FD_HD bool point_inside(T x, T y, T x1, T y1, T x2, T y2, T eps) {
  const T m = min_(min_(x - x1, y - y1), min_(x2 - x, y2 - y));
  return m > eps;
}

// Column of label l in the assigners' scores, which drop the background column from a
// one-hot over 0..C: l < bg -> l, l > bg -> l - 1, bg -> none (-1); none outside [0, C].
FD_HD int64_t score_column(int64_t label, int64_t bg_index, int64_t num_classes) {
  if (label < 0 || label > num_classes || label == bg_index) return -1;
  const int64_t col = label < bg_index ? label : label - 1;
  return col < num_classes ? col : -1;
}

}  // namespace fastdet
