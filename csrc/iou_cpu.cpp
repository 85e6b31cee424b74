// CPU kernels of the IoU family: pairwise IoU / GIoU and the paired GIoU loss.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "box_math.h"
#include "ops.h"

namespace fastdet {
namespace {

// Roughly how many output elements one parallel task should own.
constexpr int64_t kGrain = 1 << 17;

// One output row: box `a` (4 values) against M boxes of b given as structure-of-arrays
// (x1, y1, x2, y2, area; each [M]) so the loop over M vectorises.
template <typename scalar_t, typename acc_t, bool kGiou>
inline void pairwise_row(const scalar_t* a, const acc_t* bx1, const acc_t* by1, const acc_t* bx2,
                  const acc_t* by2, const acc_t* barea, int64_t M, acc_t eps, scalar_t* out) {
  const acc_t ax1 = a[0], ay1 = a[1], ax2 = a[2], ay2 = a[3];
  const acc_t area_a = clamped_area(ax1, ay1, ax2, ay2);
  for (int64_t j = 0; j < M; ++j) {
    const acc_t v = kGiou ? pair_giou(ax1, ay1, ax2, ay2, area_a, bx1[j], by1[j], bx2[j], by2[j], barea[j], eps)
                          : pair_iou(ax1, ay1, ax2, ay2, area_a, bx1[j], by1[j], bx2[j], by2[j], barea[j], eps);
    out[j] = static_cast<scalar_t>(v);
  }
}

// The float rows, multi-versioned (see FD_CPU_CLONES).
FD_CPU_CLONES void iou_row_f32(const float* a, const float* bx1, const float* by1, const float* bx2,
                               const float* by2, const float* barea, int64_t M, float eps, float* out) {
  pairwise_row<float, float, false>(a, bx1, by1, bx2, by2, barea, M, eps, out);
}

FD_CPU_CLONES void giou_row_f32(const float* a, const float* bx1, const float* by1, const float* bx2,
                                const float* by2, const float* barea, int64_t M, float eps, float* out) {
  pairwise_row<float, float, true>(a, bx1, by1, bx2, by2, barea, M, eps, out);
}

template <typename scalar_t, typename acc_t, bool kGiou>
void row(const scalar_t* a, const acc_t* bx1, const acc_t* by1, const acc_t* bx2, const acc_t* by2,
         const acc_t* barea, int64_t M, acc_t eps, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    (kGiou ? giou_row_f32 : iou_row_f32)(a, bx1, by1, bx2, by2, barea, M, eps, out);
  } else {
    pairwise_row<scalar_t, acc_t, kGiou>(a, bx1, by1, bx2, by2, barea, M, eps, out);
  }
}

template <bool kGiou>
at::Tensor pairwise(const at::Tensor& a_in, const at::Tensor& b_in, double eps, const char* op) {
  check_pairwise(a_in, b_in, op);
  const bool batched = a_in.dim() == 3;
  const at::Tensor a = (batched ? a_in : a_in.unsqueeze(0)).contiguous();  // [B,N,4]
  const at::Tensor b = (batched ? b_in : b_in.unsqueeze(0)).contiguous();  // [B,M,4]
  const int64_t B = a.size(0), N = a.size(1), M = b.size(1);
  at::Tensor out = at::empty({B, N, M}, a.options());
  if (out.numel() == 0) return batched ? out : out.squeeze(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "fastdet_pairwise", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // b as [B, 5, M] accumulation-type planes: x1, y1, x2, y2, clamped area.
    std::vector<acc_t> soa(static_cast<size_t>(B * 5 * M));
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < B * M; ++i) {
      const int64_t bi = i / M, j = i % M;
      acc_t* plane = soa.data() + bi * 5 * M;
      const acc_t x1 = bp[4 * i], y1 = bp[4 * i + 1], x2 = bp[4 * i + 2], y2 = bp[4 * i + 3];
      plane[j] = x1;
      plane[M + j] = y1;
      plane[2 * M + j] = x2;
      plane[3 * M + j] = y2;
      plane[4 * M + j] = clamped_area(x1, y1, x2, y2);
    }
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(M, 1));
    at::parallel_for(0, B * N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const acc_t* plane = soa.data() + (r / N) * 5 * M;
        row<scalar_t, acc_t, kGiou>(ap + 4 * r, plane, plane + M, plane + 2 * M, plane + 3 * M, plane + 4 * M, M, e,
                                    op_ + r * M);
      }
    });
  });
  return batched ? out : out.squeeze(0);
}

}  // namespace

at::Tensor box_iou_cpu(const at::Tensor& a, const at::Tensor& b, double eps) {
  return pairwise<false>(a, b, eps, "box_iou");
}

at::Tensor generalized_box_iou_cpu(const at::Tensor& a, const at::Tensor& b, double eps) {
  return pairwise<true>(a, b, eps, "generalized_box_iou");
}

at::Tensor giou_loss_cpu(const at::Tensor& pred_in, const at::Tensor& target_in, double eps) {
  check_paired(pred_in, target_in, "giou_loss");
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  auto out_sizes = pred.sizes().vec();
  out_sizes.pop_back();
  at::Tensor out = at::empty(out_sizes, pred.options());
  const int64_t n = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pred.scalar_type(), "giou_loss", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p = pred.const_data_ptr<scalar_t>();
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t pb[4], tb[4];
        for (int k = 0; k < 4; ++k) {
          pb[k] = p[4 * i + k];
          tb[k] = t[4 * i + k];
        }
        o[i] = static_cast<scalar_t>(giou_loss_fwd(pb, tb, e));
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> giou_loss_backward_cpu(const at::Tensor& grad_in, const at::Tensor& pred_in,
                                                          const at::Tensor& target_in, double eps) {
  check_paired(pred_in, target_in, "giou_loss_backward");
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.numel() / 4;
  TORCH_CHECK(grad_in.numel() == n, "fastdet.ops.giou_loss_backward: grad has ", grad_in.numel(),
              " elements, expected ", n);
  const at::Tensor grad = grad_in.to(pred.scalar_type()).contiguous();
  at::Tensor gp = at::empty_like(pred), gt = at::empty_like(target);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pred.scalar_type(), "giou_loss_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p = pred.const_data_ptr<scalar_t>();
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* gpp = gp.data_ptr<scalar_t>();
    scalar_t* gtp = gt.data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t pb[4], tb[4], dp[4], dt[4];
        for (int k = 0; k < 4; ++k) {
          pb[k] = p[4 * i + k];
          tb[k] = t[4 * i + k];
        }
        giou_loss_bwd(pb, tb, e, static_cast<acc_t>(g[i]), dp, dt);
        for (int k = 0; k < 4; ++k) {
          gpp[4 * i + k] = static_cast<scalar_t>(dp[k]);
          gtp[4 * i + k] = static_cast<scalar_t>(dt[k]);
        }
      }
    });
  });
  return {gp, gt};
}

}  // namespace fastdet
