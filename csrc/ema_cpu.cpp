// Fused EMA update on the CPU: one parallel pass over every element of every EMA tensor.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "box_math.h"

#include "ops.h"

namespace fastdet {
namespace {

// Elements per parallel task: large, so that a small update stays on one thread (an
// OpenMP region costs more than a few thousand lerps, and much more on a busy machine).
constexpr int64_t kGrain = 1 << 18;

struct Job {
  void* ema;
  const void* src;
  int64_t numel;
};

// e[k] = lerp(e[k], s[k], w) over [lo, hi): torch's two-sided formula, with the side
// chosen once (w is the same for every element) so the loop vectorises.
template <typename scalar_t, typename acc_t>
inline void lerp_range(scalar_t* __restrict e, const scalar_t* __restrict s, int64_t lo, int64_t hi, acc_t w) {
  const acc_t aw = w < acc_t(0) ? -w : w;
  if (aw < acc_t(0.5)) {
    for (int64_t k = lo; k < hi; ++k) {
      const acc_t x = static_cast<acc_t>(e[k]);
      e[k] = static_cast<scalar_t>(x + w * (static_cast<acc_t>(s[k]) - x));
    }
  } else {
    const acc_t w1 = acc_t(1) - w;
    for (int64_t k = lo; k < hi; ++k) {
      const acc_t y = static_cast<acc_t>(s[k]);
      e[k] = static_cast<scalar_t>(y - (y - static_cast<acc_t>(e[k])) * w1);
    }
  }
}

// The float and double loops, multi-versioned (see FD_CPU_CLONES).
FD_CPU_CLONES void lerp_range_f32(float* __restrict e, const float* __restrict s, int64_t lo, int64_t hi, float w) {
  lerp_range<float, float>(e, s, lo, hi, w);
}

FD_CPU_CLONES void lerp_range_f64(double* __restrict e, const double* __restrict s, int64_t lo, int64_t hi, double w) {
  lerp_range<double, double>(e, s, lo, hi, w);
}

template <typename scalar_t, typename acc_t>
void lerp_dispatch(scalar_t* e, const scalar_t* s, int64_t lo, int64_t hi, acc_t w) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    lerp_range_f32(e, s, lo, hi, w);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    lerp_range_f64(e, s, lo, hi, w);
  } else {
    lerp_range<scalar_t, acc_t>(e, s, lo, hi, w);
  }
}

// lerp every job of one dtype, the element range [0, total) split across threads.
template <typename scalar_t>
void lerp_jobs(const std::vector<Job>& jobs, double w) {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<int64_t> start(jobs.size() + 1, 0);  // prefix sums of numel
  for (size_t i = 0; i < jobs.size(); ++i) start[i + 1] = start[i] + jobs[i].numel;
  const acc_t wa = static_cast<acc_t>(w);
  at::parallel_for(0, start.back(), kGrain, [&](int64_t begin, int64_t end) {
    size_t j = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t pos = begin; pos < end; ++j) {
      const int64_t lo = pos - start[j];
      const int64_t hi = std::min(end, start[j + 1]) - start[j];
      lerp_dispatch(static_cast<scalar_t*>(jobs[j].ema), static_cast<const scalar_t*>(jobs[j].src), lo, hi, wa);
      pos = start[j] + hi;
    }
  });
}

}  // namespace

void ema_update_cpu(at::TensorList ema, at::TensorList src, const at::Tensor& decay) {
  check_ema(ema, src, decay);
  // The weight 1 - decay is formed in the decay's own dtype, as `1.0 - decay` is in the reference.
  const double d = decay.item<double>();
  const double w = decay.scalar_type() == at::kFloat ? static_cast<double>(1.0f - static_cast<float>(d)) : 1.0 - d;
  std::vector<Job> f32, f64, f16, bf16;
  for (size_t i = 0; i < ema.size(); ++i) {
    const at::Tensor& e = ema[i];
    const at::Tensor& s = src[i];
    if (!e.is_floating_point()) {
      e.copy_(s);
      continue;
    }
    if (e.scalar_type() != s.scalar_type() || !same_dense_layout(e, s)) {
      // Rare layouts go through ATen; the common case (same dtype, one dense layout:
      // contiguous or channels-last) is fused below.
      at::Tensor(e).lerp_(s.to(e.scalar_type()), w);
      continue;
    }
    Job job{e.data_ptr(), s.const_data_ptr(), e.numel()};
    switch (e.scalar_type()) {
      case at::kFloat: f32.push_back(job); break;
      case at::kDouble: f64.push_back(job); break;
      case at::kHalf: f16.push_back(job); break;
      case at::kBFloat16: bf16.push_back(job); break;
      default: at::Tensor(e).lerp_(s, w);
    }
  }
  if (!f32.empty()) lerp_jobs<float>(f32, w);
  if (!f64.empty()) lerp_jobs<double>(f64, w);
  if (!f16.empty()) lerp_jobs<at::Half>(f16, w);
  if (!bf16.empty()) lerp_jobs<at::BFloat16>(bf16, w);
}

}  // namespace fastdet
