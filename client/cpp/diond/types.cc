#include "diond/types.h"

#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace diond::client {
namespace {

// Bytes of `shape` in `dtype`; -1 if a dimension is negative or the product overflows.
int64_t ShapeBytes(const std::vector<int64_t>& shape, int64_t elem_bytes) {
  int64_t n = elem_bytes;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > INT64_MAX / d) return -1;
    n *= d;
  }
  return n;
}

bool InArena(int64_t offset, int64_t size, int64_t arena) {
  return offset >= 0 && size >= 0 && offset <= arena && size <= arena - offset;
}

}  // namespace

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

const TensorLayout* Layout::Find(absl::string_view name) const {
  for (const TensorLayout& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<Layout> LayoutFromProto(const v1::CreateSessionResponse& resp) {
  Layout layout;
  layout.session_id = resp.session_id();
  layout.param_arena_bytes = resp.param_arena_bytes();
  layout.grad_arena_bytes = resp.grad_arena_bytes();
  layout.alignment_bytes = resp.alignment_bytes();
  layout.fd_channel_socket = resp.fd_channel_socket();
  for (int k : resp.region_kinds()) {
    if (k == v1::REGION_KIND_MEMFD) layout.memfd_regions = !layout.fd_channel_socket.empty();
  }
  if (layout.param_arena_bytes < 0 || layout.grad_arena_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("layout: negative arena size (param ",
                                                   layout.param_arena_bytes, ", grad ",
                                                   layout.grad_arena_bytes, ")"));
  }
  if (layout.alignment_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: alignment_bytes ", layout.alignment_bytes, " < 0"));
  }
  std::set<std::string> names;
  for (const v1::TensorLayout& p : resp.layout()) {
    TensorLayout t;
    t.name = p.name();
    t.param_offset_bytes = p.param_offset_bytes();
    t.grad_offset_bytes = p.grad_offset_bytes();
    t.size_bytes = p.size_bytes();
    t.shape.assign(p.shape().begin(), p.shape().end());
    if (p.dtype() != v1::DTYPE_F32 && p.dtype() != v1::DTYPE_BF16 && p.dtype() != v1::DTYPE_F16) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout: tensor '", t.name, "' has dtype ", p.dtype()));
    }
    t.dtype = static_cast<DType>(p.dtype());
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("layout: tensor '", t.name, "' twice"));
    }
    int64_t expect = ShapeBytes(t.shape, DTypeSize(t.dtype));
    if (expect != t.size_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout: tensor '", t.name, "': size_bytes ", t.size_bytes, " != shape [",
                       absl::StrJoin(t.shape, ","), "] x ", DTypeSize(t.dtype), " bytes"));
    }
    if (!InArena(t.param_offset_bytes, t.size_bytes, layout.param_arena_bytes) ||
        !InArena(t.grad_offset_bytes, t.size_bytes, layout.grad_arena_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layout: tensor '", t.name, "' [param ", t.param_offset_bytes, ", grad ",
          t.grad_offset_bytes, ", ", t.size_bytes, " bytes] outside its arenas (param ",
          layout.param_arena_bytes, ", grad ", layout.grad_arena_bytes, " bytes)"));
    }
    if (layout.alignment_bytes > 0 && (t.param_offset_bytes % layout.alignment_bytes != 0 ||
                                       t.grad_offset_bytes % layout.alignment_bytes != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layout: tensor '", t.name, "' offsets not multiples of ", layout.alignment_bytes));
    }
    layout.tensors.push_back(std::move(t));
  }
  return layout;
}

ConstTensorRef ConstTensorRef::F32(std::string name, absl::Span<const float> values) {
  return {std::move(name),
          absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(values.data()),
                                    values.size() * sizeof(float)),
          DType::kF32};
}

ConstTensorRef ConstTensorRef::BF16(std::string name, absl::Span<const uint16_t> values) {
  return {std::move(name),
          absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(values.data()),
                                    values.size() * sizeof(uint16_t)),
          DType::kBF16};
}

MutableTensorRef MutableTensorRef::F32(std::string name, absl::Span<float> values) {
  return {std::move(name), absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(values.data()),
                                               values.size() * sizeof(float))};
}

MutableTensorRef MutableTensorRef::BF16(std::string name, absl::Span<uint16_t> values) {
  return {std::move(name), absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(values.data()),
                                               values.size() * sizeof(uint16_t))};
}

std::vector<float> Tensor::AsF32() const {
  std::vector<float> out;
  if (dtype != DType::kF32) return out;
  out.resize(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

v1::Hyperparameters ToProto(const Hyperparams& hp) {
  v1::Hyperparameters out;
  if (hp.lr) out.set_lr(*hp.lr);
  if (hp.mu) out.set_mu(*hp.mu);
  if (hp.beta1) out.set_beta1(*hp.beta1);
  if (hp.beta2) out.set_beta2(*hp.beta2);
  if (hp.weight_decay) out.set_weight_decay(*hp.weight_decay);
  if (hp.epsilon) out.set_epsilon(*hp.epsilon);
  if (hp.nesterov) out.set_nesterov(*hp.nesterov);
  if (hp.cautious_wd) out.set_cautious_wd(*hp.cautious_wd);
  if (hp.qr_method) out.set_qr_method(static_cast<v1::QrMethod>(*hp.qr_method));
  if (hp.cqr_warmup_steps) out.set_cqr_warmup_steps(*hp.cqr_warmup_steps);
  if (hp.rcqr_oversample) out.set_oversample(*hp.rcqr_oversample);
  return out;
}

v1::CreateSessionRequest ToProto(const std::vector<ParamSpec>& params,
                                 const std::vector<GroupSpec>& groups,
                                 const SessionOptions& options) {
  v1::CreateSessionRequest req;
  for (const ParamSpec& p : params) {
    v1::ParameterSpec* s = req.add_parameters();
    s->set_name(p.name);
    for (int64_t d : p.shape) s->add_shape(d);
    s->set_dtype(static_cast<v1::DType>(p.dtype));
    s->set_group(p.group);
  }
  for (const GroupSpec& g : groups) {
    v1::ParameterGroup* pg = req.add_groups();
    pg->set_name(g.name);
    pg->set_algorithm(static_cast<v1::Algorithm>(g.algorithm));
    *pg->mutable_hyperparameters() = ToProto(g.hyperparams);
  }
  req.set_fp32_master_weights(options.fp32_master_weights);
  req.set_client_name(options.client_name);
  req.set_session_name(options.session_name);
  return req;
}

StepResult FromProto(const v1::StepResponse& resp) {
  StepResult r;
  r.step_index = resp.step_index();
  r.skipped = resp.skipped();
  r.replayed = resp.replayed();
  r.update_norms.insert(resp.update_norms().begin(), resp.update_norms().end());
  r.compute_micros = resp.compute_micros();
  r.total_micros = resp.total_micros();
  r.grad_norm = resp.grad_norm();
  r.queued = resp.queued();
  if (resp.has_previous()) r.previous.push_back(FromProto(resp.previous()));
  return r;
}

}  // namespace diond::client
