// CUDA registration of fastdet.ops.fcos_assign: argument checks, allocation and the launch
// of fcos.cu's kernel (declared in fcos_cuda.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fcos_cuda.h"

namespace fastdet {

// Defined in fcos_cpu.cpp (both variants build it).
void check_fcos_inputs(const at::Tensor& points, const at::Tensor& strides, const at::Tensor& size_ranges,
                       const at::Tensor& gt_boxes, const at::Tensor& gt_labels, const at::Tensor& gt_mask);

namespace {

std::tuple<at::Tensor, at::Tensor> fcos_assign_cuda(const at::Tensor& points, const at::Tensor& strides,
                                                    const at::Tensor& size_ranges, const at::Tensor& gt_boxes,
                                                    const at::Tensor& gt_labels, const at::Tensor& gt_mask,
                                                    double radius) {
  check_fcos_inputs(points, strides, size_ranges, gt_boxes, gt_labels, gt_mask);
  c10::cuda::CUDAGuard guard(gt_boxes.device());
  const int64_t A = points.size(0), B = gt_boxes.size(0), M = gt_boxes.size(1);
  TORCH_CHECK(B <= 65535, "fastdet.ops.fcos_assign (CUDA): at most 65535 images, got ", B);
  const at::Tensor P = points.contiguous(), S = strides.contiguous(), R = size_ranges.contiguous();
  const at::Tensor G = gt_boxes.contiguous();
  const at::Tensor L = gt_labels.to(at::kLong).contiguous();
  const at::Tensor V = gt_mask.to(at::kBool).contiguous();
  at::Tensor assigned = at::empty({B, A}, G.options().dtype(at::kLong));
  at::Tensor labels = at::empty({B, A}, G.options().dtype(at::kLong));
  cuda::fcos_assign(P.const_data_ptr<float>(), S.const_data_ptr<float>(), R.const_data_ptr<float>(),
                    G.const_data_ptr<float>(), L.const_data_ptr<int64_t>(), V.const_data_ptr<bool>(), B, M, A,
                    static_cast<float>(radius), assigned.data_ptr<int64_t>(), labels.data_ptr<int64_t>(),
                    c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {assigned, labels};
}

}  // namespace
}  // namespace fastdet

TORCH_LIBRARY_IMPL(fastdet, CUDA, m) { m.impl("fcos_assign", &fastdet::fcos_assign_cuda); }
