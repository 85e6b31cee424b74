// FCOS assignment (fastdet/ops/fcos.py is the reference), shared by the CPU and CUDA
// kernels. Both work point by point: each (image, point) scans the image's M ground-truth
// slots and keeps the smallest box it is positive for, so nothing of size [B, M, A] (let
// alone [B, M, A, 4]) is ever formed.
#pragma once

#include <cstdint>

#include "box_math.h"

namespace fastdet {

// The per-point constants: position, radius * stride, level range (lo, hi) in px.
struct FcosPoint {
  float x, y, rs, lo, hi;
};

// Area of box (x1, y1, x2, y2) if point p is positive for it, else a negative value.
// Same operations, in the same order, as the reference (float32; x * 0.5f == x / 2).
FD_HD float fcos_candidate_area(const FcosPoint& p, float x1, float y1, float x2, float y2) {
  const float l = p.x - x1, t = p.y - y1, r = x2 - p.x, b = y2 - p.y;
  const bool inside = min_(min_(l, t), min_(r, b)) > 0.0f;
  const float cx = (x1 + x2) * 0.5f, cy = (y1 + y2) * 0.5f;
  float dx = p.x - cx, dy = p.y - cy;
  dx = dx < 0.0f ? -dx : dx;
  dy = dy < 0.0f ? -dy : dy;
  const bool near = max_(dx, dy) < p.rs;
  const float far = max_(max_(l, t), max_(r, b));
  if (!(inside && near && far > p.lo && far < p.hi)) return -1.0f;
  return (x2 - x1) * (y2 - y1);
}

}  // namespace fastdet
