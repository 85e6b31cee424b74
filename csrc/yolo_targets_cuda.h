// Launcher of the yolo_targets CUDA kernels (yolo_targets.cu), for yolo_targets_cuda.cpp.
// Plain C++ types only, like cuda_kernels.h, so the .cu file needs no torch headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "yolo_targets.h"

namespace fastdet {
namespace cuda {

// Enqueues on `stream`: claim the cells (winner = the last box), then write them.
void yolo_targets(const YoloSpec& s, YoloView v, int64_t B, int64_t M, YoloOut o, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastdet
