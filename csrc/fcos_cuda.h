// Launcher of the CUDA FCOS assignment kernel (fcos.cu); plain C++ types only, like
// cuda_kernels.h, so fcos.cu compiles without torch headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastdet {
namespace cuda {

// points [A,2], strides [A], ranges [A,2], boxes [B,M,4] f32; labels [B,M] i64; mask [B,M]
// bool -> assigned [B,A] i64 (-1 background) and its labels [B,A] i64 (-1 background).
void fcos_assign(const float* points, const float* strides, const float* ranges, const float* boxes,
                 const int64_t* labels, const bool* mask, int64_t B, int64_t M, int64_t A, float radius,
                 int64_t* assigned, int64_t* assigned_labels, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastdet
