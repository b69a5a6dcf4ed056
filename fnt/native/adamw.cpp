// CPU AdamW for fnt: one multithreaded pass over every element of every tensor of a param group.
//
// The work list of a call (all tensors of a group) is flattened into one index space and split
// into equal contiguous ranges, one per thread, so thousands of small tensors cost about what one
// tensor of the same total size costs. Each element is read once and written once: fp32 params
// are updated in place; bf16/fp16 params are written from their fp32 master in the same pass.
//
// The arithmetic follows torch's fused CPU AdamW (the AVX2 kernel x86-64 builds of torch run,
// also on AVX-512 CPUs) operation by operation: scalars computed in double and rounded to
// float once, the lerp as one fma, and v * beta2 + (1 - beta2) * g * g as the fma torch's
// compiler forms, fma((1 - beta2) * g, g, v * beta2). torch runs the last numel % 8 elements
// of each tensor through scalar code whose compiler formed the other fma,
// fma(v, beta2, (1 - beta2) * g * g); we do the same there. So on such machines the results
// equal torch.optim.AdamW(fused=True) bit for bit. Build with -ffp-contract=off so the
// compiler forms no fma other than those written here.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

namespace {

// Elements per inner block: small enough that the float staging buffers stay in L1.
constexpr int64_t kBlock = 512;
// Below this many elements in a call the OpenMP fork/join costs more than it saves.
constexpr int64_t kGrain = 1 << 15;
// Lanes of torch's vectorized AdamW loop; the remainder of a tensor is its scalar tail.
constexpr int64_t kTorchLanes = 8;

enum class Kind : uint8_t { F32, BF16, F16 };

struct Item {
  void* param;            // fp32 weights (updated in place) or the low-precision copy (written)
  const void* grad;       // read only
  float* exp_avg;
  float* exp_avg_sq;
  float* master;          // fp32 weights of a low-precision param; null for fp32 params
  int64_t numel;
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bias_corr2_sqrt;  // sqrt(1 - beta2^step)
  Kind param_kind;
  Kind grad_kind;
};

struct Hyper {
  float decay;    // 1 - lr * weight_decay
  // lerp(m, g, w) with w = 1 - beta1 as torch computes it: fma(w, g - m, m) when |w| < 0.5,
  // else fma(w - 1, g - m, g); coeff is w or w - 1 accordingly.
  float coeff;
  float beta2;
  float one_minus_beta2;
  float eps;
};

Kind kind_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Kind::F32;
    case at::kBFloat16:
      return Kind::BF16;
    case at::kHalf:
      return Kind::F16;
    default:
      TORCH_CHECK(false, "CPUAdamW: ", what, " dtype must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

// Widening loads. bf16 is the high half of an fp32, so a shift is exact and vectorizes.
inline void to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n,
                     Kind kind) {
  if (kind == Kind::BF16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      dst[i] = f;
    }
    return;
  }
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
  }
}

// Narrowing stores, round to nearest even. NaN is kept a quiet NaN (adding the rounding bias
// to a NaN payload could otherwise carry into infinity).
inline void from_float(const float* __restrict src, uint16_t* __restrict dst, int64_t n,
                       Kind kind) {
  if (kind == Kind::BF16) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, src + i, sizeof bits);
      const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
      dst[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7FC0u : rounded);
    }
    return;
  }
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) {
    dst[i] = c10::Half(src[i]).x;
  }
}

// The AdamW update of n contiguous fp32 elements; everything is float so it vectorizes.
// Operation order mirrors torch's fused CPU kernel, kTail its scalar tail; see the file comment.
template <bool kLerpSmall, bool kTail>
inline void adamw_block(float* __restrict w, const float* __restrict g, float* __restrict m,
                        float* __restrict v, int64_t n, const Hyper& h, float neg_step_size,
                        float bias_corr2_sqrt) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i];
    const float m1 = std::fma(h.coeff, gi - mi, kLerpSmall ? mi : gi);
    const float v1 = kTail ? std::fma(v[i], h.beta2, h.one_minus_beta2 * gi * gi)
                           : std::fma(h.one_minus_beta2 * gi, gi, v[i] * h.beta2);
    const float denom = std::sqrt(v1) / bias_corr2_sqrt + h.eps;
    m[i] = m1;
    v[i] = v1;
    w[i] = w[i] * h.decay + neg_step_size * m1 / denom;
  }
}

template <bool kLerpSmall>
void update_range(const Item& it, int64_t lo, int64_t hi, const Hyper& h) {
  float gbuf[kBlock];
  float* weights = it.master != nullptr ? it.master : static_cast<float*>(it.param);
  const int64_t tail_start = it.numel - it.numel % kTorchLanes;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    const float* g;
    if (it.grad_kind == Kind::F32) {
      g = static_cast<const float*>(it.grad) + b;
    } else {
      to_float(static_cast<const uint16_t*>(it.grad) + b, gbuf, n, it.grad_kind);
      g = gbuf;
    }
    const int64_t body = std::clamp<int64_t>(tail_start - b, 0, n);
    adamw_block<kLerpSmall, false>(weights + b, g, it.exp_avg + b, it.exp_avg_sq + b, body, h,
                                   it.neg_step_size, it.bias_corr2_sqrt);
    adamw_block<kLerpSmall, true>(weights + b + body, g + body, it.exp_avg + b + body,
                                  it.exp_avg_sq + b + body, n - body, h, it.neg_step_size,
                                  it.bias_corr2_sqrt);
    if (it.master != nullptr) {
      from_float(weights + b, static_cast<uint16_t*>(it.param) + b, n, it.param_kind);
    }
  }
}

// Runs fn(item_index, lo, hi) over the flattened index space [0, offsets.back()) split evenly
// across threads; offsets[i] is where item i starts.
template <typename Fn>
void for_each_range(const std::vector<int64_t>& offsets, const Fn& fn) {
  const int64_t total = offsets.back();
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    auto idx = static_cast<int64_t>(
        std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1);
    for (int64_t pos = begin; pos < end; ++idx) {
      const int64_t stop = std::min(end, offsets[idx + 1]);
      if (stop > pos) {
        fn(idx, pos - offsets[idx], stop - offsets[idx]);
      }
      pos = std::max(pos, stop);
    }
  });
}

void check_fp32_state(const at::Tensor& ref, const at::Tensor& t, const char* what,
                      int64_t index) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "CPUAdamW: ", what,
              " of param ", index, " must be a float32 CPU tensor");
  TORCH_CHECK(t.sizes() == ref.sizes() && t.strides() == ref.strides(), "CPUAdamW: ", what,
              " of param ", index, " must have the param's shape and strides");
}

// Validates a call's tensors, then increments each step counter and returns the items; so a
// failed check leaves every counter as it was. The bias corrections are computed in double
// from the float step, as torch does, once per distinct step value. grad_copies receives
// re-laid-out grads the items point into; it must outlive them.
std::vector<Item> make_items(std::deque<at::Tensor>& grad_copies,
                             const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads,
                             const std::vector<at::Tensor>& exp_avgs,
                             const std::vector<at::Tensor>& exp_avg_sqs,
                             const std::vector<std::optional<at::Tensor>>& masters,
                             const std::vector<at::Tensor>& steps, double lr, double beta1,
                             double beta2) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count &&
                  masters.size() == count && steps.size() == count,
              "CPUAdamW: tensor lists must have equal lengths");
  std::vector<Item> items;
  std::vector<float*> step_ptrs;
  items.reserve(count);
  step_ptrs.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& p = params[i];
    const auto index = static_cast<int64_t>(i);
    TORCH_CHECK(p.device().is_cpu(), "CPUAdamW: param ", index, " is not on CPU");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "CPUAdamW: param ", index,
                " must be dense (no gaps or overlaps in memory)");
    const at::Tensor* grad = &grads[i];
    TORCH_CHECK(grad->device().is_cpu() && grad->sizes() == p.sizes(), "CPUAdamW: grad of param ",
                index, " must be a CPU tensor of the param's shape");
    if (grad->strides() != p.strides()) {
      // The update walks memory linearly, so the grad needs the param's layout; copy it
      // (the caller's grad stays untouched) and keep the copy alive for this call.
      grad_copies.push_back(at::empty_like(p, grad->options()).copy_(*grad));
      grad = &grad_copies.back();
    }
    check_fp32_state(p, exp_avgs[i], "exp_avg", index);
    check_fp32_state(p, exp_avg_sqs[i], "exp_avg_sq", index);
    const Kind param_kind = kind_of(p, "param");
    float* master = nullptr;
    if (param_kind != Kind::F32) {
      TORCH_CHECK(masters[i].has_value(), "CPUAdamW: low-precision param ", index,
                  " needs an fp32 master");
      check_fp32_state(p, *masters[i], "master", index);
      master = masters[i]->data_ptr<float>();
    }
    const at::Tensor& step = steps[i];
    TORCH_CHECK(step.device().is_cpu() && step.scalar_type() == at::kFloat && step.numel() == 1,
                "CPUAdamW: step of param ", index, " must be a float32 CPU scalar");
    step_ptrs.push_back(step.data_ptr<float>());
    items.push_back(Item{p.data_ptr(), grad->const_data_ptr(), exp_avgs[i].data_ptr<float>(),
                         exp_avg_sqs[i].data_ptr<float>(), master, p.numel(), 0.0f, 0.0f,
                         param_kind, kind_of(*grad, "grad")});
  }
  float last_step = -1.0f;
  float neg_step_size = 0.0f;
  float bias_corr2_sqrt = 0.0f;
  for (size_t i = 0; i < count; ++i) {
    const float step = *step_ptrs[i] += 1.0f;
    if (step != last_step) {
      last_step = step;
      const double s = step;
      neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, s))));
      bias_corr2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, s)));
    }
    items[i].neg_step_size = neg_step_size;
    items[i].bias_corr2_sqrt = bias_corr2_sqrt;
  }
  return items;
}

std::vector<int64_t> item_offsets(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> offsets(params.size() + 1, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    offsets[i + 1] = offsets[i] + params[i].numel();
  }
  return offsets;
}

void adamw_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<std::optional<at::Tensor>>& masters,
                 const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                 double eps, double weight_decay) {
  std::deque<at::Tensor> grad_copies;
  const std::vector<Item> items = make_items(grad_copies, params, grads, exp_avgs, exp_avg_sqs,
                                             masters, steps, lr, beta1, beta2);
  if (items.empty()) {
    return;
  }
  const auto lerp_weight = static_cast<float>(1.0 - beta1);
  const bool lerp_small = std::abs(lerp_weight) < 0.5f;
  const Hyper h{static_cast<float>(1.0 - lr * weight_decay),
                lerp_small ? lerp_weight : lerp_weight - 1.0f, static_cast<float>(beta2),
                static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  const std::vector<int64_t> offsets = item_offsets(params);
  if (lerp_small) {
    for_each_range(offsets, [&](int64_t i, int64_t lo, int64_t hi) {
      update_range<true>(items[i], lo, hi, h);
    });
  } else {
    for_each_range(offsets, [&](int64_t i, int64_t lo, int64_t hi) {
      update_range<false>(items[i], lo, hi, h);
    });
  }
}

// Bandwidth probe for scripts/bench_adamw.py: the AdamW memory traffic of fp32 params (read
// p, g, m, v; write p, m, v) with trivial arithmetic and the same work split as adamw_step_.
void stream_probe_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count,
              "stream_probe_: tensor lists must have equal lengths");
  std::vector<float*> p(count), m(count), v(count);
  std::vector<const float*> g(count);
  for (size_t i = 0; i < count; ++i) {
    const auto index = static_cast<int64_t>(i);
    TORCH_CHECK(params[i].scalar_type() == at::kFloat && params[i].is_contiguous(),
                "stream_probe_: params must be contiguous float32");
    check_fp32_state(params[i], grads[i], "grad", index);
    check_fp32_state(params[i], exp_avgs[i], "exp_avg", index);
    check_fp32_state(params[i], exp_avg_sqs[i], "exp_avg_sq", index);
    p[i] = params[i].data_ptr<float>();
    g[i] = grads[i].const_data_ptr<float>();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
  }
  for_each_range(item_offsets(params), [&](int64_t i, int64_t lo, int64_t hi) {
    float* __restrict pi = p[i];
    const float* __restrict gi = g[i];
    float* __restrict mi = m[i];
    float* __restrict vi = v[i];
    for (int64_t k = lo; k < hi; ++k) {
      const float gk = gi[k];
      pi[k] += gk;
      mi[k] += gk;
      vi[k] += gk;
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fnt CPU AdamW kernel";
  m.def("adamw_step_", &adamw_step_, py::call_guard<py::gil_scoped_release>(),
        "One AdamW step over a param group; increments each step counter in place.",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("masters"), py::arg("steps"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"));
  m.def("stream_probe_", &stream_probe_, py::call_guard<py::gil_scoped_release>(),
        "Bandwidth probe with AdamW's fp32 memory traffic (benchmark only).", py::arg("params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"));
}
