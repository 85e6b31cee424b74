// CPU kernels of the label assigners (fastdet/ops/assigners.py is the reference).
//
// Neither kernel forms a [B, M, A] tensor. Both work in two stages:
//  1. per ground-truth box (parallel over B*M): choose its candidate anchors
//     (task-aligned: top-k alignment metric; ATSS: top-k centre distance per level and
//     the mean + std IoU threshold) and keep those that are positive -> cand [B, M, K];
//  2. per image (parallel over B): count the GTs each anchor is positive for, give an
//     anchor claimed by several GTs to the GT of highest IoU x pad mask (argmax over all
//     M slots, first on ties), and write labels [B, A], boxes [B, A, 4], scores [B, A, C].
// Top-k ties go to the lower anchor index, as torch.topk does on the CPU when it partially
// sorts (k * 64 <= n; for smaller rows its order among equal values is unspecified).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "box_math.h"
#include "ops.h"

namespace fastdet {
namespace {

constexpr double kInsideEps = 1e-9;  // points_inside_boxes(eps=1e-9)
// About this many anchor visits per parallel task: below it a stage runs on one thread
// (an OpenMP region costs more than a small assignment, and far more on a busy machine).
constexpr int64_t kWorkPerTask = 1 << 20;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kWorkPerTask / std::max<int64_t>(work_per_item, 1));
}
constexpr double kIouEps = 1e-9;     // pairwise_iou(eps=1e-9)

// A bounded list of the best (value, index) pairs, best first. `Larger` picks the order:
// larger values first (task-aligned metric) or smaller first (ATSS distance); ties go
// to the lower index either way.
template <typename T, bool Larger>
struct TopK {
  std::vector<T> val;
  std::vector<int64_t> idx;
  int64_t k;
  explicit TopK(int64_t k_) : k(k_) {
    val.reserve(k);
    idx.reserve(k);
  }
  static bool better(T v, int64_t i, T w, int64_t j) {
    if (Larger ? v > w : v < w) return true;
    return v == w && i < j;
  }
  bool full() const { return static_cast<int64_t>(val.size()) == k; }
  void push(T v, int64_t i) {
    if (full()) {
      if (!better(v, i, val.back(), idx.back())) return;
      val.pop_back();
      idx.pop_back();
    }
    size_t pos = val.size();
    val.push_back(v);
    idx.push_back(i);
    while (pos > 0 && better(v, i, val[pos - 1], idx[pos - 1])) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = v;
    idx[pos] = i;
  }
};

void check_gt(const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask,
              const char* op) {
  TORCH_CHECK(gt_bboxes.dim() == 3 && gt_bboxes.size(2) == 4, "fastdet.ops.", op,
              ": gt_bboxes must be [B, M, 4], got ", gt_bboxes.sizes());
  const int64_t B = gt_bboxes.size(0), M = gt_bboxes.size(1);
  TORCH_CHECK(gt_labels.numel() == B * M, "fastdet.ops.", op, ": gt_labels must be [B, M, 1] = [", B, ", ",
              M, ", 1], got ", gt_labels.sizes());
  TORCH_CHECK(pad_gt_mask.numel() == B * M, "fastdet.ops.", op, ": pad_gt_mask must be [B, M, 1] = [", B,
              ", ", M, ", 1], got ", pad_gt_mask.sizes());
}

// Stage 2, shared: resolve each anchor of image b to at most one GT.
// cand: [M, K] positive anchor indices (-1 = none). iou_of(m, a) gives the tie-break IoU
// (already multiplied by the slot's pad mask: padded slots compete with IoU 0).
// Returns assigned GT per anchor (-1 = background).
template <typename IouFn>
void resolve_image(const int64_t* cand, int64_t M, int64_t K, int64_t A, IouFn iou_of, std::vector<int32_t>& count,
                   std::vector<int32_t>& owner) {
  std::fill(count.begin(), count.end(), 0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t a = cand[m * K + j];
      if (a >= 0) {
        ++count[a];
        owner[a] = static_cast<int32_t>(m);
      }
    }
  }
  for (int64_t a = 0; a < A; ++a) {
    if (count[a] == 0) {
      owner[a] = -1;
    } else if (count[a] > 1) {
      int32_t best_m = 0;
      auto best = iou_of(0, a);
      for (int64_t m = 1; m < M; ++m) {
        const auto v = iou_of(m, a);
        if (v > best) {
          best = v;
          best_m = static_cast<int32_t>(m);
        }
      }
      owner[a] = best_m;
    }
  }
}

template <typename scalar_t>
void tal_kernel(const at::Tensor& scores_t, const at::Tensor& pred_t, const at::Tensor& points_t,
                const at::Tensor& labels_t, const at::Tensor& gtb_t, const at::Tensor& mask_t, int64_t bg_index,
                int64_t topk, double alpha_d, double beta_d, double eps_d, at::Tensor& out_labels,
                at::Tensor& out_bboxes, at::Tensor& out_scores) {
  using T = scalar_t;
  const int64_t B = scores_t.size(0), A = scores_t.size(1), C = scores_t.size(2), M = gtb_t.size(1);
  const int64_t K = std::min(topk, A);
  const T* S = scores_t.const_data_ptr<T>();
  const T* P = pred_t.const_data_ptr<T>();
  const T* pts = points_t.const_data_ptr<T>();
  const int64_t* L = labels_t.const_data_ptr<int64_t>();
  const T* G = gtb_t.const_data_ptr<T>();
  const T* V = mask_t.const_data_ptr<T>();
  const T alpha = static_cast<T>(alpha_d), beta = static_cast<T>(beta_d), eps = static_cast<T>(eps_d);
  const T in_eps = static_cast<T>(kInsideEps), iou_eps = static_cast<T>(kIouEps);

  auto iou_of = [&](int64_t b, int64_t m, int64_t a) {
    const T* g = G + (b * M + m) * 4;
    const T* p = P + (b * A + a) * 4;
    return paddle_iou(g[0], g[1], g[2], g[3], p[0], p[1], p[2], p[3], iou_eps);
  };
  auto metric_of = [&](int64_t b, int64_t m, int64_t a) {
    const int64_t lab = L[b * M + m];
    const T s = (lab >= 0 && lab < C) ? S[(b * A + a) * C + lab] : T(0);
    return static_cast<T>(std::pow(s, alpha) * std::pow(iou_of(b, m, a), beta));
  };
  auto inside = [&](int64_t b, int64_t m, int64_t a) {
    const T* g = G + (b * M + m) * 4;
    return point_inside(pts[2 * a], pts[2 * a + 1], g[0], g[1], g[2], g[3], in_eps);
  };

  // Stage 1: per GT, the top-K anchors by metric * inside (zeros tie on the index, as
  // in torch.topk), kept when inside the GT.
  std::vector<int64_t> cand(static_cast<size_t>(B * M * K), -1);
  at::parallel_for(0, B * M, grain_for(A), [&](int64_t begin, int64_t end) {
    TopK<T, true> top(K);
    for (int64_t bm = begin; bm < end; ++bm) {
      if (V[bm] == T(0)) continue;
      const int64_t b = bm / M, m = bm % M;
      top.val.clear();
      top.idx.clear();
      for (int64_t a = 0; a < A; ++a) {
        const bool in = inside(b, m, a);
        // An outside anchor scores exactly 0 and cannot displace anything once the list
        // is full (every entry is >= 0 and has a lower index).
        if (!in && top.full()) continue;
        top.push(in ? metric_of(b, m, a) : T(0), a);
      }
      for (int64_t j = 0; j < K; ++j) {
        const int64_t a = top.idx[j];
        cand[bm * K + j] = inside(b, m, a) ? a : -1;
      }
    }
  });

  // Stage 2: per image.
  int64_t* OL = out_labels.data_ptr<int64_t>();
  T* OB = out_bboxes.data_ptr<T>();
  T* OS = out_scores.data_ptr<T>();
  at::parallel_for(0, B, grain_for(A * (C + M)), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(A), owner(A);
    std::vector<T> metric(A), max_metric(M), max_iou(M);
    for (int64_t b = begin; b < end; ++b) {
      resolve_image(cand.data() + b * M * K, M, K, A,
                    [&](int64_t m, int64_t a) { return iou_of(b, m, a) * V[b * M + m]; },
                    count, owner);
      std::fill(max_metric.begin(), max_metric.end(), T(0));
      std::fill(max_iou.begin(), max_iou.end(), T(0));
      for (int64_t a = 0; a < A; ++a) {
        const int32_t m = owner[a];
        if (m < 0) continue;
        metric[a] = metric_of(b, m, a);
        max_metric[m] = max_(max_metric[m], metric[a]);
        max_iou[m] = max_(max_iou[m], iou_of(b, m, a));
      }
      for (int64_t a = 0; a < A; ++a) {
        const int32_t m = owner[a];
        const int64_t gm = m < 0 ? 0 : m;
        const int64_t lab = m < 0 ? bg_index : L[b * M + m];
        OL[b * A + a] = lab;
        for (int k = 0; k < 4; ++k) OB[(b * A + a) * 4 + k] = G[(b * M + gm) * 4 + k];
        T* row = OS + (b * A + a) * C;
        std::fill(row, row + C, T(0));
        if (m >= 0) {
          const int64_t col = score_column(lab, bg_index, C);
          if (col >= 0) row[col] = metric[a] / (max_metric[m] + eps) * max_iou[m];
        }
      }
    }
  });
}

template <typename scalar_t>
void atss_kernel(const at::Tensor& anchors_t, c10::IntArrayRef levels, const at::Tensor& labels_t,
                 const at::Tensor& gtb_t, const at::Tensor& mask_t, const at::Tensor* pred_t, int64_t bg_index,
                 int64_t C, int64_t topk, at::Tensor& out_labels, at::Tensor& out_bboxes, at::Tensor& out_scores) {
  using T = scalar_t;
  const int64_t A = anchors_t.size(0), B = gtb_t.size(0), M = gtb_t.size(1);
  int64_t K = 0;
  for (int64_t n : levels) K += std::min(topk, n);
  const T* AN = anchors_t.const_data_ptr<T>();
  const int64_t* L = labels_t.const_data_ptr<int64_t>();
  const T* G = gtb_t.const_data_ptr<T>();
  const T* V = mask_t.const_data_ptr<T>();
  const T* P = pred_t ? pred_t->const_data_ptr<T>() : nullptr;
  const T in_eps = static_cast<T>(kInsideEps), iou_eps = static_cast<T>(kIouEps);

  std::vector<T> acx(A), acy(A);  // anchor centres, (x1 + x2) / 2 as in the reference
  for (int64_t a = 0; a < A; ++a) {
    acx[a] = (AN[4 * a] + AN[4 * a + 2]) / T(2);
    acy[a] = (AN[4 * a + 1] + AN[4 * a + 3]) / T(2);
  }
  auto anchor_iou = [&](int64_t b, int64_t m, int64_t a) {
    const T* g = G + (b * M + m) * 4;
    const T* p = AN + a * 4;
    return paddle_iou(g[0], g[1], g[2], g[3], p[0], p[1], p[2], p[3], iou_eps);
  };

  // Stage 1a: per GT, the topk nearest anchor centres on each level and their IoUs
  // (zeros for padded slots, like the reference's masked candidates).
  std::vector<int64_t> cand(static_cast<size_t>(B * M * K), -1);
  at::Tensor cand_iou_t = at::zeros({B, M, K}, gtb_t.options());
  T* CI = cand_iou_t.data_ptr<T>();
  at::parallel_for(0, B * M, grain_for(A), [&](int64_t begin, int64_t end) {
    for (int64_t bm = begin; bm < end; ++bm) {
      if (V[bm] == T(0)) continue;
      const int64_t b = bm / M, m = bm % M;
      const T* g = G + bm * 4;
      const T gcx = (g[0] + g[2]) / T(2), gcy = (g[1] + g[3]) / T(2);
      int64_t start = 0, j = 0;
      for (int64_t n : levels) {
        TopK<T, false> top(std::min(topk, n));
        for (int64_t a = start; a < start + n; ++a) {
          const double dx = static_cast<double>(gcx - acx[a]), dy = static_cast<double>(gcy - acy[a]);
          top.push(static_cast<T>(std::sqrt(dx * dx + dy * dy)), a);
        }
        for (int64_t i : top.idx) {
          cand[bm * K + j] = i;
          CI[bm * K + j] = anchor_iou(b, m, i);
          ++j;
        }
        start += n;
      }
    }
  });
  // Stage 1b: threshold = mean + unbiased std of the candidates' IoUs, computed by the same
  // ATen reductions as the reference so that it agrees to the bit (an IoU equal to the
  // threshold is common: anchors of one level lying inside a GT all have the same IoU).
  const at::Tensor thr_t = (cand_iou_t.mean(-1) + cand_iou_t.std(-1)).contiguous();  // [B, M]
  const T* TH = thr_t.const_data_ptr<T>();
  // Stage 1c: keep candidates above the threshold whose centre lies inside the GT.
  at::parallel_for(0, B * M, grain_for(K * 64), [&](int64_t begin, int64_t end) {
    for (int64_t bm = begin; bm < end; ++bm) {
      if (V[bm] == T(0)) continue;
      const T* g = G + bm * 4;
      for (int64_t i = 0; i < K; ++i) {
        const int64_t a = cand[bm * K + i];
        const bool pos = CI[bm * K + i] > TH[bm] && point_inside(acx[a], acy[a], g[0], g[1], g[2], g[3], in_eps);
        if (!pos) cand[bm * K + i] = -1;
      }
    }
  });

  int64_t* OL = out_labels.data_ptr<int64_t>();
  T* OB = out_bboxes.data_ptr<T>();
  T* OS = out_scores.data_ptr<T>();
  at::parallel_for(0, B, grain_for(A * (C + M)), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(A), owner(A);
    for (int64_t b = begin; b < end; ++b) {
      resolve_image(cand.data() + b * M * K, M, K, A,
                    [&](int64_t m, int64_t a) { return anchor_iou(b, m, a) * V[b * M + m]; },
                    count, owner);
      for (int64_t a = 0; a < A; ++a) {
        const int32_t m = owner[a];
        const int64_t gm = m < 0 ? 0 : m;
        const int64_t lab = m < 0 ? bg_index : L[b * M + m];
        OL[b * A + a] = lab;
        const T* g = G + (b * M + gm) * 4;
        for (int k = 0; k < 4; ++k) OB[(b * A + a) * 4 + k] = g[k];
        T* row = OS + (b * A + a) * C;
        std::fill(row, row + C, T(0));
        if (m >= 0) {
          const int64_t col = score_column(lab, bg_index, C);
          if (col < 0) continue;
          if (P) {
            const T* p = P + (b * A + a) * 4;
            row[col] = paddle_iou(g[0], g[1], g[2], g[3], p[0], p[1], p[2], p[3], iou_eps);
          } else {
            row[col] = T(1);
          }
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> task_aligned_assign_cpu(
    const at::Tensor& pred_scores, const at::Tensor& pred_bboxes, const at::Tensor& anchor_points,
    const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask, int64_t bg_index,
    int64_t topk, double alpha, double beta, double eps) {
  TORCH_CHECK(pred_scores.dim() == 3, "fastdet.ops.task_aligned_assign: pred_scores must be [B, A, C], got ",
              pred_scores.sizes());
  const int64_t B = pred_scores.size(0), A = pred_scores.size(1), C = pred_scores.size(2);
  TORCH_CHECK(pred_bboxes.sizes() == at::IntArrayRef({B, A, 4}),
              "fastdet.ops.task_aligned_assign: pred_bboxes must be [B, A, 4] = [", B, ", ", A, ", 4], got ",
              pred_bboxes.sizes());
  TORCH_CHECK(anchor_points.sizes() == at::IntArrayRef({A, 2}),
              "fastdet.ops.task_aligned_assign: anchor_points must be [A, 2] = [", A, ", 2], got ",
              anchor_points.sizes());
  check_gt(gt_labels, gt_bboxes, pad_gt_mask, "task_aligned_assign");
  TORCH_CHECK(gt_bboxes.size(0) == B, "fastdet.ops.task_aligned_assign: gt_bboxes has ", gt_bboxes.size(0),
              " images, pred_scores ", B);
  TORCH_CHECK(topk >= 1, "fastdet.ops.task_aligned_assign: topk must be >= 1, got ", topk);
  const auto dt = pred_scores.scalar_type();
  const at::Tensor S = pred_scores.contiguous(), P = pred_bboxes.to(dt).contiguous();
  const at::Tensor pts = anchor_points.to(dt).contiguous(), G = gt_bboxes.to(dt).contiguous();
  const at::Tensor Lb = gt_labels.to(at::kLong).contiguous(), Vm = pad_gt_mask.to(dt).contiguous();
  const int64_t M = G.size(1);
  at::Tensor labels = at::empty({B, A}, S.options().dtype(at::kLong));
  at::Tensor bboxes = at::empty({B, A, 4}, S.options());
  at::Tensor scores = at::empty({B, A, C}, S.options());
  if (B * A == 0) return {labels, bboxes, scores};
  if (M == 0) {
    labels.fill_(bg_index);
    bboxes.zero_();
    scores.zero_();
    return {labels, bboxes, scores};
  }
  AT_DISPATCH_FLOATING_TYPES(dt, "task_aligned_assign", [&] {
    tal_kernel<scalar_t>(S, P, pts, Lb, G, Vm, bg_index, topk, alpha, beta, eps, labels, bboxes, scores);
  });
  return {labels, bboxes, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> atss_assign_cpu(
    const at::Tensor& anchors, c10::IntArrayRef num_anchors_list, const at::Tensor& gt_labels,
    const at::Tensor& gt_bboxes, const at::Tensor& pad_gt_mask, const std::optional<at::Tensor>& pred_bboxes,
    int64_t bg_index, int64_t num_classes, int64_t topk, double /*eps*/) {
  TORCH_CHECK(anchors.dim() == 2 && anchors.size(1) == 4, "fastdet.ops.atss_assign: anchors must be [A, 4], got ",
              anchors.sizes());
  check_gt(gt_labels, gt_bboxes, pad_gt_mask, "atss_assign");
  const int64_t A = anchors.size(0), B = gt_bboxes.size(0), M = gt_bboxes.size(1);
  int64_t total = 0;
  for (int64_t n : num_anchors_list) {
    TORCH_CHECK(n >= 1, "fastdet.ops.atss_assign: every level needs at least one anchor, got ", num_anchors_list);
    total += n;
  }
  TORCH_CHECK(total == A, "fastdet.ops.atss_assign: num_anchors_list sums to ", total, ", anchors has ", A, " rows");
  TORCH_CHECK(topk >= 1, "fastdet.ops.atss_assign: topk must be >= 1, got ", topk);
  const auto dt = gt_bboxes.scalar_type();
  const at::Tensor AN = anchors.to(dt).contiguous(), G = gt_bboxes.contiguous();
  const at::Tensor Lb = gt_labels.to(at::kLong).contiguous(), Vm = pad_gt_mask.to(dt).contiguous();
  at::Tensor P;
  if (pred_bboxes.has_value()) {
    TORCH_CHECK(pred_bboxes->sizes() == at::IntArrayRef({B, A, 4}),
                "fastdet.ops.atss_assign: pred_bboxes must be [B, A, 4] = [", B, ", ", A, ", 4], got ",
                pred_bboxes->sizes());
    P = pred_bboxes->to(dt).contiguous();
  }
  at::Tensor labels = at::empty({B, A}, G.options().dtype(at::kLong));
  at::Tensor bboxes = at::empty({B, A, 4}, G.options());
  at::Tensor scores = at::empty({B, A, num_classes}, G.options());
  if (B * A == 0) return {labels, bboxes, scores};
  if (M == 0) {
    labels.fill_(bg_index);
    bboxes.zero_();
    scores.zero_();
    return {labels, bboxes, scores};
  }
  AT_DISPATCH_FLOATING_TYPES(dt, "atss_assign", [&] {
    atss_kernel<scalar_t>(AN, num_anchors_list, Lb, G, Vm, pred_bboxes.has_value() ? &P : nullptr, bg_index,
                          num_classes, topk, labels, bboxes, scores);
  });
  return {labels, bboxes, scores};
}

}  // namespace fastdet
