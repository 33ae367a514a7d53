#include "kernels/cpu/onednn_matmul.h"

#include <oneapi/dnnl/dnnl.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/engine_choice.h"

namespace diond::kernels::cpu {
namespace {

dnnl::memory::data_type ToDnnl(DType t) {
  switch (t) {
    case DType::kF32:
      return dnnl::memory::data_type::f32;
    case DType::kBf16:
      return dnnl::memory::data_type::bf16;
    case DType::kF16:
      return dnnl::memory::data_type::f16;
  }
  return dnnl::memory::data_type::undef;
}

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);  // never destroyed
  return *engine;
}

}  // namespace

struct OneDnnMatmul::Impl {
  dnnl::memory::desc a_md, b_md, c_md;
  dnnl::matmul prim;
};

OneDnnMatmul::OneDnnMatmul(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OneDnnMatmul::~OneDnnMatmul() = default;

absl::StatusOr<std::unique_ptr<OneDnnMatmul>> OneDnnMatmul::Create(const MatmulShape& s) {
  const bool bf16 =
      s.a_type == DType::kBf16 || s.b_type == DType::kBf16 || s.c_type == DType::kBf16;
  if (bf16 && !CpuHasOneDnnBf16Matmul()) {
    return absl::FailedPreconditionError(
        absl::StrCat("oneDNN matmul ", s.m, "x", s.k, "x", s.n, " (", DTypeName(s.a_type), "->",
                     DTypeName(s.c_type),
                     "): this CPU has no AVX-512 core, and oneDNN 2.6 has no bf16 "
                     "matmul without it; use bf16_matmul=auto or float32_gemm"));
  }
  try {
    auto impl = std::make_unique<Impl>();
    using dims = dnnl::memory::dims;
    impl->a_md =
        dnnl::memory::desc(dims{s.m, s.k}, ToDnnl(s.a_type), dims{s.a_strides[0], s.a_strides[1]});
    impl->b_md =
        dnnl::memory::desc(dims{s.k, s.n}, ToDnnl(s.b_type), dims{s.b_strides[0], s.b_strides[1]});
    impl->c_md =
        dnnl::memory::desc(dims{s.m, s.n}, ToDnnl(s.c_type), dims{s.c_strides[0], s.c_strides[1]});
    dnnl::primitive_attr attr;
    if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
    if (s.beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(s.beta);
      attr.set_post_ops(po);
    }
    dnnl::matmul::desc desc(impl->a_md, impl->b_md, impl->c_md);
    dnnl::matmul::primitive_desc pd(desc, attr, CpuEngine());
    impl->prim = dnnl::matmul(pd);
    return std::unique_ptr<OneDnnMatmul>(new OneDnnMatmul(std::move(impl)));
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul ", s.m, "x", s.k, "x", s.n, " (",
                                            DTypeName(s.a_type), "->", DTypeName(s.c_type),
                                            "): ", e.what()));
  }
}

absl::Status OneDnnMatmul::Execute(const void* a, const void* b, void* c) const {
  try {
    dnnl::engine& eng = CpuEngine();
    thread_local dnnl::stream stream(eng);
    dnnl::memory am(impl_->a_md, eng, const_cast<void*>(a));
    dnnl::memory bm(impl_->b_md, eng, const_cast<void*>(b));
    dnnl::memory cm(impl_->c_md, eng, c);
    impl_->prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
    return absl::OkStatus();
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul execute: ", e.what()));
  }
}

}  // namespace diond::kernels::cpu
