// SimOTA (YOLOX) arithmetic shared by the CPU (simota_cpu.cpp) and CUDA (simota.cu) kernels.
// fastdet/ops/simota.py is the reference; every formula follows it operation by operation.
//
// The plan never forms a [B, M, A] tensor:
//  0. per point (b, a): is it a candidate (inside any real GT box or centre square), and
//     neg_sum = sum_c BCE(sqrt(score_c), 0);
//  1. per GT (b, m): one pass over the candidates keeps the top-k IoUs (their float64 sum,
//     floored, at least 1, is the dynamic k) and the k cheapest points by (cost + 1e5 if
//     not in box and centre square) in float64, ties to the lower point index;
//  2. per point: claimed once -> that GT; several times -> the GT of least key over all
//     real GTs (the first on ties); then the IoU of the point's prediction with it.
#pragma once

#include <cmath>
#include <cstdint>

#include "box_math.h"

namespace fastdet {

constexpr int kSimotaMaxTopk = 32;
constexpr double kSimotaPenalty = 1e5;

template <typename T>
FD_HD T log_(T x) {
#if defined(__CUDA_ARCH__)
  return log(x);
#else
  return std::log(x);
#endif
}

template <typename T>
FD_HD T log1p_(T x) {
#if defined(__CUDA_ARCH__)
  return log1p(x);
#else
  return std::log1p(x);
#endif
}

template <typename T>
FD_HD T sqrt_(T x) {
#if defined(__CUDA_ARCH__)
  return sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// BCE(q, 0) = -log(1 - q) and BCE(q, 1) = -log(q), each clamped at 100 (F.binary_cross_entropy).
template <typename T>
FD_HD T bce_neg(T q) {
  return min_(-log1p_(-q), T(100));
}

template <typename T>
FD_HD T bce_pos(T q) {
  return min_(-log_(q), T(100));
}

// The inputs of one call. Shapes: scores [B,A,C], pred [B,A,4] xyxy, points [A,2],
// strides [A], gt [B,M,4] xyxy, labels [B,M], mask [B,M]; cand [B,A] and neg_sum [B,A]
// are stage 0's outputs.
template <typename T>
struct SimotaView {
  const T* scores;
  const T* pred;
  const T* points;
  const T* strides;
  const T* gt;
  const int64_t* labels;
  const bool* mask;
  const uint8_t* cand;
  const T* neg_sum;
  int64_t B, A, C, M;
  T radius;
  T iou_weight;

  FD_HD void inside(int64_t b, int64_t m, int64_t a, bool& in_box, bool& in_ctr) const {
    const T* g = gt + (b * M + m) * 4;
    const T x = points[2 * a], y = points[2 * a + 1];
    in_box = (x - g[0] > T(0)) && (y - g[1] > T(0)) && (g[2] - x > T(0)) && (g[3] - y > T(0));
    const T cx = (g[0] + g[2]) / T(2), cy = (g[1] + g[3]) / T(2);
    const T r = radius * strides[a];
    in_ctr = (x - (cx - r) > T(0)) && (y - (cy - r) > T(0)) && ((cx + r) - x > T(0)) && ((cy + r) - y > T(0));
  }

  // reference.box_iou of GT m with the prediction of point a.
  FD_HD T iou(int64_t b, int64_t m, int64_t a) const {
    const T* g = gt + (b * M + m) * 4;
    const T* p = pred + (b * A + a) * 4;
    return pair_iou(g[0], g[1], g[2], g[3], clamped_area(g[0], g[1], g[2], g[3]), p[0], p[1], p[2], p[3],
                    clamped_area(p[0], p[1], p[2], p[3]), T(1e-9));
  }

  // cost + 1e5 * !(in box and in centre square), in float64.
  FD_HD double key(int64_t b, int64_t m, int64_t a, T iou_value, bool both) const {
    int64_t l = labels[b * M + m];
    l = l < 0 ? 0 : (l >= C ? C - 1 : l);
    const T q = sqrt_(scores[(b * A + a) * C + l]);
    const T cls = (neg_sum[b * A + a] - bce_neg(q)) + bce_pos(q);
    const T cost = cls + iou_weight * (-log_(iou_value + T(1e-8)));
    return static_cast<double>(cost) + (both ? 0.0 : kSimotaPenalty);
  }

  // Stage 0 for point (b, a).
  FD_HD void point_info(int64_t b, int64_t a, uint8_t* cand_out, T* neg_sum_out) const {
    bool c = false;
    for (int64_t m = 0; m < M && !c; ++m) {
      if (!mask[b * M + m]) continue;
      bool in_box, in_ctr;
      inside(b, m, a, in_box, in_ctr);
      c = in_box || in_ctr;
    }
    *cand_out = c ? 1 : 0;
    const T* s = scores + (b * A + a) * C;
    T sum = T(0);
    for (int64_t c2 = 0; c2 < C; ++c2) sum += bce_neg(sqrt_(s[c2]));
    *neg_sum_out = sum;
  }
};

// The best n <= KMAX (value, index) pairs, best first: the largest values (Larger) or the
// smallest; ties to the lower index.
template <typename V, int KMAX, bool Larger>
struct SmallTopK {
  V val[KMAX];
  int64_t idx[KMAX];
  int n = 0;
  int k;
  FD_HD explicit SmallTopK(int k_) : k(k_) {}
  FD_HD static bool better(V v, int64_t i, V w, int64_t j) {
    return (Larger ? v > w : v < w) || (v == w && i < j);
  }
  FD_HD void push(V v, int64_t i) {
    if (n == k) {
      if (!better(v, i, val[n - 1], idx[n - 1])) return;
      --n;
    }
    int pos = n++;
    while (pos > 0 && better(v, i, val[pos - 1], idx[pos - 1])) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = v;
    idx[pos] = i;
  }
};

// Stage 1 for real GT (b, m): writes the claimed points to out[0..k) (-1 past the dynamic k).
template <typename T, int KMAX>
FD_HD void simota_scan_gt(const SimotaView<T>& v, int64_t b, int64_t m, int k, int64_t* out) {
  SmallTopK<T, KMAX, true> top_iou(k);
  SmallTopK<double, KMAX, false> cheapest(k);
  for (int64_t a = 0; a < v.A; ++a) {
    if (!v.cand[b * v.A + a]) continue;
    bool in_box, in_ctr;
    v.inside(b, m, a, in_box, in_ctr);
    const T iou = v.iou(b, m, a);
    top_iou.push(iou, a);
    cheapest.push(v.key(b, m, a, iou, in_box && in_ctr), a);
  }
  double sum = 0.0;
  for (int j = 0; j < top_iou.n; ++j) sum += static_cast<double>(top_iou.val[j]);
  const int64_t dyn_k = sum < 1.0 ? 1 : static_cast<int64_t>(sum);  // floor of a positive sum
  for (int j = 0; j < k; ++j) out[j] = (j < cheapest.n && j < dyn_k) ? cheapest.idx[j] : -1;
}

// Stage 2's tie-break: the real GT of least key at point a (first on ties).
template <typename T>
FD_HD int64_t simota_cheapest_gt(const SimotaView<T>& v, int64_t b, int64_t a) {
  int64_t best_m = -1;
  double best = 0.0;
  for (int64_t m = 0; m < v.M; ++m) {
    if (!v.mask[b * v.M + m]) continue;
    bool in_box, in_ctr;
    v.inside(b, m, a, in_box, in_ctr);
    const double key = v.key(b, m, a, v.iou(b, m, a), in_box && in_ctr);
    if (best_m < 0 || key < best) {
      best = key;
      best_m = m;
    }
  }
  return best_m;
}

}  // namespace fastdet
