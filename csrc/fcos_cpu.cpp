// CPU kernel of fastdet.ops.fcos_assign (reference: fastdet/ops/fcos.py), registered here
// for the CPU dispatch key; the schema is in ops.cpp, the fake in fastdet/ops/_ext.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "fcos.h"

namespace fastdet {

void check_fcos_inputs(const at::Tensor& points, const at::Tensor& strides, const at::Tensor& size_ranges,
                       const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask) {
  const char* op = "fastdet.ops.fcos_assign";
  TORCH_CHECK(points.dim() == 2 && points.size(1) == 2, op, ": points must be [A, 2], got ", points.sizes());
  const int64_t A = points.size(0);
  TORCH_CHECK(strides.dim() == 1 && strides.size(0) == A, op, ": strides must be [", A, "], got ", strides.sizes());
  TORCH_CHECK(size_ranges.dim() == 2 && size_ranges.size(0) == A && size_ranges.size(1) == 2, op,
              ": size_ranges must be [", A, ", 2], got ", size_ranges.sizes());
  TORCH_CHECK(gt_boxes.dim() == 3 && gt_boxes.size(2) == 4, op, ": gt_boxes must be [B, M, 4], got ",
              gt_boxes.sizes());
  const int64_t B = gt_boxes.size(0), M = gt_boxes.size(1);
  TORCH_CHECK(gt_labels.numel() == B * M && gt_mask.numel() == B * M, op, ": gt_labels and gt_mask must be [", B,
              ", ", M, "], got ", gt_labels.sizes(), " and ", gt_mask.sizes());
  for (const at::Tensor* t : {&points, &strides, &size_ranges, &gt_boxes}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": points, strides, size_ranges and gt_boxes must be float32 ",
                "(the dispatch sends other dtypes to the reference), got ", t->scalar_type());
  }
}

namespace {

constexpr int64_t kWorkPerTask = 1 << 18;  // box visits per parallel task (see assign_cpu.cpp)

std::tuple<at::Tensor, at::Tensor> fcos_assign_cpu(const at::Tensor& points, const at::Tensor& strides,
                                                   const at::Tensor& size_ranges, const at::Tensor& gt_boxes,
                                                   const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                                                   double radius) {
  check_fcos_inputs(points, strides, size_ranges, gt_boxes, gt_labels, gt_mask);
  const int64_t A = points.size(0), B = gt_boxes.size(0), M = gt_boxes.size(1);
  const at::Tensor P = points.contiguous(), S = strides.contiguous(), R = size_ranges.contiguous();
  const at::Tensor G = gt_boxes.contiguous();
  const at::Tensor L = gt_labels.to(at::kLong).contiguous().reshape({B, M});
  const at::Tensor V = gt_mask.to(at::kBool).contiguous().reshape({B, M});
  at::Tensor assigned = at::empty({B, A}, G.options().dtype(at::kLong));
  at::Tensor labels = at::empty({B, A}, G.options().dtype(at::kLong));
  if (B * A == 0) return {assigned, labels};
  const float* pp = P.const_data_ptr<float>();
  const float* sp = S.const_data_ptr<float>();
  const float* rp = R.const_data_ptr<float>();
  const float* gp = G.const_data_ptr<float>();
  const int64_t* lp = L.const_data_ptr<int64_t>();
  const bool* vp = V.const_data_ptr<bool>();
  int64_t* out_gt = assigned.data_ptr<int64_t>();
  int64_t* out_label = labels.data_ptr<int64_t>();
  const float rad = static_cast<float>(radius);
  const int64_t grain = std::max<int64_t>(1, kWorkPerTask / std::max<int64_t>(M, 1));
  at::parallel_for(0, B * A, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / A, a = i % A;
      const FcosPoint p{pp[2 * a], pp[2 * a + 1], sp[a] * rad, rp[2 * a], rp[2 * a + 1]};
      int64_t best = -1;
      float best_area = std::numeric_limits<float>::infinity();
      for (int64_t m = 0; m < M; ++m) {
        if (!vp[b * M + m]) continue;
        const float* g = gp + (b * M + m) * 4;
        const float area = fcos_candidate_area(p, g[0], g[1], g[2], g[3]);
        // Strictly smaller: the first slot wins on equal areas, as argmin does.
        if (area >= 0.0f && (best < 0 || area < best_area)) {
          best = m;
          best_area = area;
        }
      }
      out_gt[i] = best;
      out_label[i] = best < 0 ? -1 : lp[b * M + best];
    }
  });
  return {assigned, labels};
}

}  // namespace
}  // namespace fastdet

TORCH_LIBRARY_IMPL(fastdet, CPU, m) { m.impl("fcos_assign", &fastdet::fcos_assign_cpu); }
