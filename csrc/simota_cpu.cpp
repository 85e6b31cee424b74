// CPU kernel of SimOTA (fastdet/ops/simota.py is the reference; the plan and the shared
// arithmetic are in simota_math.h). Stage 0 runs over points, stage 1 over GTs and stage 2
// over images, each with at::parallel_for; nothing of size [B, M, A] is allocated.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <array>
#include <vector>

#include "ops.h"
#include "simota_math.h"

namespace fastdet {
namespace {

// About this many point visits per parallel task (an OpenMP region costs more than a
// small assignment, and far more on a busy machine).
constexpr int64_t kWorkPerTask = 1 << 18;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kWorkPerTask / std::max<int64_t>(work_per_item, 1));
}

template <typename T>
void simota_kernel(const SimotaView<T>& v, int k, at::Tensor& out_gt, at::Tensor& out_iou, uint8_t* cand,
                   T* neg_sum) {
  const int64_t B = v.B, A = v.A, M = v.M;
  at::parallel_for(0, B * A, grain_for(M + v.C), [&](int64_t begin, int64_t end) {
    for (int64_t ba = begin; ba < end; ++ba) v.point_info(ba / A, ba % A, cand + ba, neg_sum + ba);
  });

  std::vector<int64_t> claimed(static_cast<size_t>(B * M * k), -1);
  at::parallel_for(0, B * M, grain_for(A), [&](int64_t begin, int64_t end) {
    for (int64_t bm = begin; bm < end; ++bm) {
      if (!v.mask[bm]) continue;
      simota_scan_gt<T, kSimotaMaxTopk>(v, bm / M, bm % M, k, claimed.data() + bm * k);
    }
  });

  int64_t* OG = out_gt.data_ptr<int64_t>();
  T* OI = out_iou.data_ptr<T>();
  at::parallel_for(0, B, grain_for(A + M * k), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(A), owner(A);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(count.begin(), count.end(), 0);
      for (int64_t m = 0; m < M; ++m) {
        for (int j = 0; j < k; ++j) {
          const int64_t a = claimed[(b * M + m) * k + j];
          if (a < 0) continue;
          ++count[a];
          owner[a] = static_cast<int32_t>(m);
        }
      }
      for (int64_t a = 0; a < A; ++a) {
        int64_t m = -1;
        if (count[a] == 1) {
          m = owner[a];
        } else if (count[a] > 1) {
          m = simota_cheapest_gt(v, b, a);
        }
        OG[b * A + a] = m;
        OI[b * A + a] = m < 0 ? T(0) : v.iou(b, m, a);
      }
    }
  });
}

}  // namespace

std::array<int64_t, 4> check_simota(const at::Tensor& pred_scores, const at::Tensor& pred_boxes,
                                    const at::Tensor& anchor_points, const at::Tensor& strides,
                                    const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                                    int64_t topk, const char* op) {
  TORCH_CHECK(pred_scores.dim() == 3, "fastdet.ops.", op, ": pred_scores must be [B, A, C], got ", pred_scores.sizes());
  const int64_t B = pred_scores.size(0), A = pred_scores.size(1), C = pred_scores.size(2);
  TORCH_CHECK(pred_boxes.sizes() == at::IntArrayRef({B, A, 4}), "fastdet.ops.", op, ": pred_boxes must be [B, A, 4] = [",
              B, ", ", A, ", 4], got ", pred_boxes.sizes());
  TORCH_CHECK(anchor_points.sizes() == at::IntArrayRef({A, 2}), "fastdet.ops.", op, ": anchor_points must be [A, 2] = [",
              A, ", 2], got ", anchor_points.sizes());
  TORCH_CHECK(strides.dim() == 1 && strides.size(0) == A, "fastdet.ops.", op, ": strides must be [A] = [", A,
              "], got ", strides.sizes());
  TORCH_CHECK(gt_boxes.dim() == 3 && gt_boxes.size(0) == B && gt_boxes.size(2) == 4, "fastdet.ops.", op,
              ": gt_boxes must be [B, M, 4] with B = ", B, ", got ", gt_boxes.sizes());
  const int64_t M = gt_boxes.size(1);
  TORCH_CHECK(gt_labels.sizes() == at::IntArrayRef({B, M}) && gt_mask.sizes() == at::IntArrayRef({B, M}),
              "fastdet.ops.", op, ": gt_labels and gt_mask must be [B, M] = [", B, ", ", M, "], got ",
              gt_labels.sizes(), " and ", gt_mask.sizes());
  TORCH_CHECK(topk >= 1 && topk <= kSimotaMaxTopk, "fastdet.ops.", op, ": topk must be in [1, ", kSimotaMaxTopk,
              "], got ", topk);
  return {B, A, C, M};
}

std::tuple<at::Tensor, at::Tensor> simota_assign_cpu(const at::Tensor& pred_scores, const at::Tensor& pred_boxes,
                                                     const at::Tensor& anchor_points, const at::Tensor& strides,
                                                     const at::Tensor& gt_boxes, const at::Tensor& gt_labels,
                                                     const at::Tensor& gt_mask, double center_radius, int64_t topk,
                                                     double iou_weight) {
  const auto checked = check_simota(pred_scores, pred_boxes, anchor_points, strides, gt_boxes, gt_labels, gt_mask,
                                    topk, "simota_assign");
  const int64_t B = checked[0], A = checked[1], C = checked[2], M = checked[3];
  TORCH_CHECK(at::isFloatingType(pred_scores.scalar_type()),
              "fastdet.ops.simota_assign: pred_scores must be a floating tensor, got ", pred_scores.scalar_type());
  const auto dt = pred_scores.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor S = pred_scores.to(dt).contiguous(), P = pred_boxes.to(dt).contiguous();
  const at::Tensor pts = anchor_points.to(dt).contiguous(), st = strides.to(dt).contiguous();
  const at::Tensor G = gt_boxes.to(dt).contiguous(), L = gt_labels.to(at::kLong).contiguous();
  const at::Tensor V = gt_mask.to(at::kBool).contiguous();
  at::Tensor out_gt = at::full({B, A}, -1, S.options().dtype(at::kLong));
  at::Tensor out_iou = at::zeros({B, A}, S.options());
  if (B * A == 0 || M == 0 || C == 0) return {out_gt, out_iou};
  const int k = static_cast<int>(std::min<int64_t>(topk, A));
  at::Tensor cand = at::empty({B, A}, S.options().dtype(at::kByte));
  at::Tensor neg_sum = at::empty({B, A}, S.options());
  AT_DISPATCH_FLOATING_TYPES(dt, "simota_assign", [&] {
    const SimotaView<scalar_t> v{S.const_data_ptr<scalar_t>(), P.const_data_ptr<scalar_t>(),
                                 pts.const_data_ptr<scalar_t>(), st.const_data_ptr<scalar_t>(),
                                 G.const_data_ptr<scalar_t>(), L.const_data_ptr<int64_t>(), V.const_data_ptr<bool>(),
                                 cand.const_data_ptr<uint8_t>(), neg_sum.const_data_ptr<scalar_t>(), B, A, C, M,
                                 static_cast<scalar_t>(center_radius), static_cast<scalar_t>(iou_weight)};
    simota_kernel<scalar_t>(v, k, out_gt, out_iou, cand.data_ptr<uint8_t>(), neg_sum.data_ptr<scalar_t>());
  });
  return {out_gt, out_iou};
}

}  // namespace fastdet
