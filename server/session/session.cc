#include "server/session/session.h"

#include <cctype>
#include <cmath>
#include <map>
#include <cstring>
#include <limits>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/validation.h"
#include "server/comm/world.h"
#include "server/session/layout.h"

namespace diond::session {
namespace {

using kernels::BFloat16;
using kernels::Float16;

void WidenToF32(DType dtype, const uint8_t* src, int64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBf16: {
      const auto* s = reinterpret_cast<const BFloat16*>(src);
      for (int64_t i = 0; i < n; ++i) out[i] = kernels::Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = reinterpret_cast<const Float16*>(src);
      for (int64_t i = 0; i < n; ++i) out[i] = kernels::F16ToFloat(s[i]);
      return;
    }
  }
}

void NarrowFromF32(DType dtype, const float* in, int64_t n, uint8_t* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, in, static_cast<size_t>(n) * 4);
      return;
    case DType::kBf16: {
      auto* d = reinterpret_cast<BFloat16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = kernels::FloatToBf16(in[i]);
      return;
    }
    case DType::kF16: {
      auto* d = reinterpret_cast<Float16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = kernels::FloatToF16(in[i]);
      return;
    }
  }
}

bool AllFinite(const float* p, int64_t n) {
  // NaN and ±Inf are exactly the values whose exponent bits are all ones. An integer OR
  // reduction over that test vectorizes without -ffast-math (a float sum would not: its order
  // matters), so the scan runs at memory speed; it is on the path of every Step.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::string_view RoleName(Role r) {
  return r == Role::kParameters ? "PARAMETERS" : "GRADIENTS";
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::string id, SessionSpec spec) {
  if (spec.params.empty()) {
    return absl::InvalidArgumentError("a session needs at least one parameter");
  }
  absl::flat_hash_map<std::string, size_t> group_index;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const std::string& name = spec.groups[g].name;
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("group ", g, " has no name"));
    if (name.size() > 512) {
      return absl::InvalidArgumentError(
          absl::StrCat("group name '", Bounded(name), "' must be 1..512 bytes"));
    }
    if (!group_index.emplace(name, g).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate group name '", Bounded(name), "'"));
    }
  }
  std::set<std::string> names;
  for (const ParamSpec& p : spec.params) {
    if (p.name.empty() || p.name.size() > 512) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter name '", Bounded(p.name), "' must be 1..512 bytes"));
    }
    if (absl::StrContains(p.name, "/state.")) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter name '", Bounded(p.name), "' may not contain '/state.'"));
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate parameter name '", Bounded(p.name), "'"));
    }
    if (!group_index.contains(p.group)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", Bounded(p.name), "' names unknown group '", Bounded(p.group), "'"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(spec.params));

  std::unique_ptr<Session> s(new Session);
  s->id_ = std::move(id);
  s->layout_ = std::move(layout);
  absl::MutexLock lock(&s->mu_);
  s->group_of_param_.resize(spec.params.size());
  s->slot_in_group_.resize(spec.params.size());
  s->groups_.resize(spec.groups.size());
  for (size_t g = 0; g < spec.groups.size(); ++g) s->groups_[g].name = spec.groups[g].name;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    size_t g = group_index[spec.params[i].group];
    s->group_of_param_[i] = g;
    s->slot_in_group_[i] = s->groups_[g].params.size();
    s->groups_[g].params.push_back(i);
  }
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    Group& group = s->groups_[g];
    if (group.params.empty()) continue;  // declared but unused: nothing to optimize
    std::vector<optim::ParamShape> shapes;
    for (size_t i : group.params) shapes.push_back(spec.params[i].shape);
    auto opt = optim::CreateGroupOptimizer(spec.groups[g].config, shapes);
    if (!opt.ok()) {
      return absl::Status(opt.status().code(), absl::StrCat("group '", Bounded(group.name), "': ",
                                                            opt.status().message()));
    }
    group.optimizer = std::move(*opt);
    for (size_t slot = 0; slot < group.params.size(); ++slot) {
      for (const std::string& st : group.optimizer->StateNames()) {
        auto shape = group.optimizer->StateShape(slot, st);
        if (shape.ok()) s->state_bytes_ += 4 * NumElements(*shape);
      }
    }
  }
  if (spec.fp32_master_weights) {
    s->master_.resize(spec.params.size());
    for (size_t i = 0; i < spec.params.size(); ++i) {
      if (spec.params[i].dtype != DType::kF32) {
        s->master_[i].resize(static_cast<size_t>(s->layout_.tensors[i].numel));
        s->state_bytes_ += 4 * s->layout_.tensors[i].numel;
      }
    }
  }
  s->spec_ = std::move(spec);
  s->last_used_ = absl::Now();
  return s;
}

absl::StatusOr<std::string> Session::RegisterShmRegion(Role role, const std::string& name,
                                                       int64_t offset, int64_t size) {
  DIOND_RETURN_IF_ERROR(ValidateShmName(name));
  const int64_t need = role == Role::kParameters ? layout_.param_arena_bytes
                                                 : layout_.grad_arena_bytes;
  if (offset < 0 || offset % kArenaAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("region offset ", offset,
                                                   " must be a non-negative multiple of ",
                                                   kArenaAlignment));
  }
  if (size < need) {
    return absl::InvalidArgumentError(absl::StrCat("region of ", size, " bytes is smaller than the ",
                                                   RoleName(role), " arena (", need, " bytes)"));
  }
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  Binding& b = binding(role);
  if (b.region != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(RoleName(role),
                                                      " already has region ", b.region_id,
                                                      "; unregister it first"));
  }
  const Binding& other = binding(role == Role::kParameters ? Role::kGradients : Role::kParameters);
  if (other.region != nullptr && other.region->name() == name) {
    int64_t a0 = offset, a1 = offset + size;
    int64_t b0 = other.region->offset(), b1 = b0 + other.region->size();
    if (a0 < b1 && b0 < a1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region [", a0, ", ", a1, ") of '", Bounded(name), "' overlaps the ",
          RoleName(role == Role::kParameters ? Role::kGradients : Role::kParameters),
          " region [", b0, ", ", b1, ")"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<ShmRegion> region,
                         ShmRegion::Open(name, offset, size, id_));
  // Remote-mode data already in a host arena, or parameters restored from a checkpoint, move
  // into the trainer's memory now, so nothing the daemon holds is lost. The daemon's copies are
  // dropped only once the trainer's memory took them intact (the segment may shrink meanwhile).
  const bool from_pending = role == Role::kParameters && !pending_params_.empty();
  if (from_pending) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const TensorPlacement& t = layout_.tensors[i];
      NarrowFromF32(t.dtype, pending_params_[i].data(), t.numel,
                    region->data() + t.param_offset);
    }
  } else if (!b.host.empty()) {
    std::memcpy(region->data(), b.host.data(), static_cast<size_t>(need));
  }
  if (absl::Status intact = region->CheckIntact(); !intact.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(RoleName(role), " ", intact.message(), "; nothing was registered"));
  }
  if (from_pending) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      if (!master_.empty() && !master_[i].empty()) master_[i] = pending_params_[i];
    }
    master_valid_ = !master_.empty();
    pending_params_.clear();
  }
  b.host.clear();
  b.host.shrink_to_fit();
  b.region = std::move(region);
  b.data = b.region->data();
  b.region_id = absl::StrCat(role == Role::kParameters ? "params-" : "grads-", next_region_++);
  return b.region_id;
}

absl::Status Session::UnregisterRegion(const std::string& region_id) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  for (Role r : {Role::kParameters, Role::kGradients}) {
    Binding& b = binding(r);
    if (b.region != nullptr && b.region_id == region_id) {
      b = Binding();
      if (r == Role::kParameters) master_valid_ = false;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("session ", id_, " has no region '", Bounded(region_id), "'"));
}

absl::Status Session::EnsureHostArena(Role r) {
  Binding& b = binding(r);
  if (b.bound()) return absl::OkStatus();
  const int64_t bytes = r == Role::kParameters ? layout_.param_arena_bytes
                                               : layout_.grad_arena_bytes;
  b.host.assign(static_cast<size_t>(bytes), 0);
  b.data = b.host.data();
  if (r == Role::kParameters && !pending_params_.empty()) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const TensorPlacement& t = layout_.tensors[i];
      NarrowFromF32(t.dtype, pending_params_[i].data(), t.numel, b.data + t.param_offset);
      if (!master_.empty() && !master_[i].empty()) master_[i] = pending_params_[i];
    }
    master_valid_ = !master_.empty();
    pending_params_.clear();
  }
  return absl::OkStatus();
}

void Session::ReadParamF32(size_t i, float* out) {
  const TensorPlacement& t = layout_.tensors[i];
  if (!master_.empty() && !master_[i].empty() && master_valid_) {
    std::memcpy(out, master_[i].data(), static_cast<size_t>(t.numel) * 4);
    return;
  }
  if (!pending_params_.empty()) {
    std::memcpy(out, pending_params_[i].data(), static_cast<size_t>(t.numel) * 4);
    return;
  }
  WidenToF32(t.dtype, params_.data + t.param_offset, t.numel, out);
}

void Session::WriteParamF32(size_t i, const float* in) {
  const TensorPlacement& t = layout_.tensors[i];
  if (!master_.empty() && !master_[i].empty()) {
    std::memcpy(master_[i].data(), in, static_cast<size_t>(t.numel) * 4);
  }
  NarrowFromF32(t.dtype, in, t.numel, params_.data + t.param_offset);
}

bool Session::GradientsF32(double scale, std::vector<std::vector<float>>* copies,
                           std::vector<const float*>* grads) {
  bool finite = true;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    const uint8_t* src = grads_.data + t.grad_offset;
    // Trainer memory (shm) is copied once, so that nothing computes on memory the trainer can
    // truncate (ShmRegion's SIGBUS guard); daemon-owned host arenas are used in place.
    if (t.dtype == DType::kF32 && scale == 1.0 && grads_.region == nullptr) {
      (*grads)[i] = reinterpret_cast<const float*>(src);
    } else {
      std::vector<float>& c = (*copies)[i];
      c.resize(static_cast<size_t>(t.numel));
      WidenToF32(t.dtype, src, t.numel, c.data());
      if (scale != 1.0) {
        const float s = static_cast<float>(scale);
        for (float& v : c) v *= s;
      }
      (*grads)[i] = c.data();
    }
    finite = finite && AllFinite((*grads)[i], t.numel);
  }
  return finite;
}

void Session::ParamsF32(std::vector<std::vector<float>>* copies, std::vector<float*>* params) {
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    if (t.dtype == DType::kF32 && params_.region == nullptr) {
      (*params)[i] = reinterpret_cast<float*>(params_.data + t.param_offset);
    } else if (!master_.empty() && !master_[i].empty()) {
      if (!master_valid_) {
        WidenToF32(t.dtype, params_.data + t.param_offset, t.numel, master_[i].data());
      }
      (*params)[i] = master_[i].data();
    } else {
      std::vector<float>& c = (*copies)[i];
      c.resize(static_cast<size_t>(t.numel));
      WidenToF32(t.dtype, params_.data + t.param_offset, t.numel, c.data());
      (*params)[i] = c.data();
    }
  }
}

std::vector<std::vector<float>>& Session::ScratchBuffers(std::vector<std::vector<float>>* v) {
  v->resize(layout_.tensors.size());  // one per tensor; each keeps its capacity between steps
  return *v;
}

absl::Status Session::CheckRegions(const char* when, std::optional<Role> only) {
  for (Role r : {Role::kParameters, Role::kGradients}) {
    if (only.has_value() && *only != r) continue;
    const Binding& b = binding(r);
    if (b.region == nullptr) continue;
    if (absl::Status s = b.region->CheckIntact(); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(when, ": the ", RoleName(r), " ", s.message(), "; nothing was changed"));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::WriteBackParams(const std::vector<float*>& params, StepResult result) {
  const std::string when = absl::StrCat("step ", result.step_index);
  // A last cheap look before the trainer's memory is written (the segment may have shrunk
  // during the computation); then the write, then whether it faulted.
  bool intact = params_.region == nullptr || params_.region->CheckIntact().ok();
  if (intact) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const TensorPlacement& t = layout_.tensors[i];
      uint8_t* dst = params_.data + t.param_offset;
      if (reinterpret_cast<uint8_t*>(params[i]) != dst) {
        NarrowFromF32(t.dtype, params[i], t.numel, dst);
      }
    }
    if (!master_.empty()) master_valid_ = true;
    intact = params_.region == nullptr || !params_.region->broken();
  }
  last_step_index_ = result.step_index;
  last_result_ = result;
  if (intact) return absl::OkStatus();
  // The step was computed and the optimizer state advanced; only the trainer's memory is gone.
  // Keep the new weights (as after a checkpoint restore) for the next PARAMETERS region, so
  // that nothing is lost, and drop the broken region.
  const std::string region = params_.region->Describe();
  std::vector<std::vector<float>> held(layout_.tensors.size());
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    held[i].assign(params[i], params[i] + layout_.tensors[i].numel);
  }
  pending_params_ = std::move(held);
  params_ = Binding();
  master_valid_ = false;
  DIOND_LOG(WARNING) << "session " << id_ << ": PARAMETERS " << region << " shrank while "
                     << when << " was written back; the daemon holds the updated weights";
  return absl::FailedPreconditionError(absl::StrCat(
      when, ": the PARAMETERS ", region,
      " shrank while the updated weights were written back. The step was applied (a replay of "
      "it answers as usual) and the daemon holds the new weights: register a new PARAMETERS "
      "region to receive them, or read them with PullParameters"));
}

namespace {
// The step number the group's update rules see: the trainer's (StepRequest::group_step), else
// the session's step index.
int64_t GroupStep(const StepRequest& request, const std::string& group) {
  auto it = request.group_step.find(group);
  return it != request.group_step.end() ? it->second : request.step_index;
}
}  // namespace

absl::StatusOr<StepResult> Session::Step(const StepRequest& request,
                                         const kernels::Context& ctx, absl::Mutex* compute_mu) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  last_used_ = start;
  if (request.step_index == last_step_index_ && last_result_.has_value() &&
      last_result_->step_index == last_step_index_) {
    StepResult r = *last_result_;
    r.replayed = true;
    return r;
  }
  // Overflow-safe: last_step_index_ is at most INT64_MAX, and no step follows INT64_MAX.
  if (last_step_index_ == std::numeric_limits<int64_t>::max()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step_index ", request.step_index, ": the session is at the last representable step"));
  }
  if (request.step_index != last_step_index_ + 1) {
    std::string why;
    if (last_step_index_ > 0 && request.step_index == last_step_index_) {
      why = absl::StrCat(" (step ", last_step_index_,
                         " was applied, but its answer is not recorded: the session was restored "
                         "from a checkpoint without it)");
    } else if (last_step_index_ > 0 && last_result_.has_value()) {
      why = absl::StrCat(" (or ", last_step_index_, " to replay the last answer)");
    }
    return absl::FailedPreconditionError(absl::StrCat("step_index ", request.step_index,
                                                      " is out of order: expected ",
                                                      last_step_index_ + 1, why));
  }
  double scale = request.gradient_scale == 0.0 ? 1.0 : request.gradient_scale;
  if (!std::isfinite(scale) || scale < 0) {
    return absl::InvalidArgumentError(absl::StrCat("gradient_scale ", request.gradient_scale,
                                                   " must be finite and >= 0"));
  }
  for (const auto& [group, lr] : request.lr_override) {
    bool known = false;
    for (const Group& g : groups_) known |= g.name == group;
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("lr_override names unknown group '", Bounded(group), "'"));
    }
    DIOND_RETURN_IF_ERROR(
        optim::CheckStepKnob(absl::StrCat("lr_override['", Bounded(group), "']"), lr, optim::kMaxLr));
  }
  for (const auto& [group, n] : request.group_step) {
    bool known = false;
    for (const Group& g : groups_) known |= g.name == group;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("group_step names unknown group '",
                                                     Bounded(group.substr(0, 64)), "'"));
    }
    if (n < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_step['", Bounded(group), "'] = ", n, " must be >= 1"));
    }
  }
  if (!params_.bound() && pending_params_.empty()) {
    return absl::FailedPreconditionError(
        "no parameters: register a PARAMETERS region (or upload them with SetState) before Step");
  }
  if (!grads_.bound()) {
    return absl::FailedPreconditionError(
        "no gradients: register a GRADIENTS region (or PushGradients) before Step");
  }
  DIOND_RETURN_IF_ERROR(EnsureHostArena(Role::kParameters));
  const std::string when = absl::StrCat("step ", request.step_index);
  // The trainer may have truncated its segments: a cheap look first (fstat), then, after each
  // pass over its memory, whether the SIGBUS guard caught a fault. Until the weights are
  // written back nothing of the session has changed.
  DIOND_RETURN_IF_ERROR(CheckRegions(when.c_str()));
  if (world_.has_value()) return WorldStepLocked(request, ctx, compute_mu, start);

  // Gradients as fp32: in place when daemon-owned f32 and unscaled; copied from shm.
  const size_t n = layout_.tensors.size();
  std::vector<std::vector<float>>& grad_copies = ScratchBuffers(&grad_scratch_);
  std::vector<const float*> grads(n);
  bool finite = GradientsF32(scale, &grad_copies, &grads);
  DIOND_RETURN_IF_ERROR(CheckRegions(when.c_str()));
  StepResult result;
  result.step_index = request.step_index;
  if (!finite) {
    if (spec_.non_finite == NonFinitePolicy::kError) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step_index, ": gradients contain NaN or Inf (non_finite_policy=ERROR)"));
    }
    result.skipped = true;
    result.total_micros = absl::ToInt64Microseconds(absl::Now() - start);
    last_step_index_ = request.step_index;
    last_result_ = result;
    return result;
  }

  // Parameters as fp32: in place for daemon-owned f32 arenas; master or copies otherwise.
  std::vector<std::vector<float>>& param_copies = ScratchBuffers(&param_scratch_);
  std::vector<float*> params(n);
  ParamsF32(&param_copies, &params);
  DIOND_RETURN_IF_ERROR(CheckRegions(when.c_str()));

  const absl::Time compute_start = absl::Now();
  {
    absl::MutexLock compute(compute_mu);
    for (Group& g : groups_) {
      if (g.optimizer == nullptr) continue;
      std::vector<float*> gp;
      std::vector<const float*> gg;
      for (size_t i : g.params) {
        gp.push_back(params[i]);
        gg.push_back(grads[i]);
      }
      optim::StepOptions opts;
      auto it = request.lr_override.find(g.name);
      if (it != request.lr_override.end()) {
        opts.lr = it->second;
      } else {
        opts.lr = g.lr;
      }
      opts.weight_decay = g.weight_decay;
      opts.step = GroupStep(request, g.name);  // the reference's group step (cqr warm-up)
      absl::Status s = g.optimizer->Step(ctx, gp, gg, opts);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat("step ", request.step_index, ", group '",
                                                   g.name, "': ", s.message()));
      }
      result.update_norms[g.name] = g.optimizer->last_update_norm();
    }
  }
  result.compute_micros = absl::ToInt64Microseconds(absl::Now() - compute_start);
  result.total_micros = absl::ToInt64Microseconds(absl::Now() - start);
  // Write back what was computed outside the arena, and record the step.
  DIOND_RETURN_IF_ERROR(WriteBackParams(params, result));
  return result;
}

absl::Status Session::ResolveStateName(const std::string& name, size_t* param, size_t* group,
                                       std::string* state, std::vector<int64_t>* shape) {
  size_t pos = name.rfind("/state.");
  if (pos == std::string::npos) return absl::NotFoundError("not a state name");
  std::string pname = name.substr(0, pos);
  *state = name.substr(pos + 7);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (layout_.tensors[i].name != pname) continue;
    *param = i;
    *group = group_of_param_[i];
    const Group& g = groups_[*group];
    auto s = g.optimizer->StateShape(slot_in_group_[i], *state);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown state '", Bounded(name), "': group '",
                                                     g.name, "' has state ",
                                                     absl::StrJoin(g.optimizer->StateNames(), ", ")));
    }
    *shape = *s;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("state '", Bounded(name), "' names unknown parameter '",
                                                 Bounded(pname), "'"));
}

absl::Status Session::CheckWriteLocked(const std::string& name, int64_t offset, int64_t len,
                                       bool state_names, int64_t* tensor_bytes) {
  int64_t size = -1;
  int64_t elem = 4;
  for (const TensorPlacement& t : layout_.tensors) {
    if (t.name == name) {
      size = t.size_bytes;
      elem = static_cast<int64_t>(kernels::DTypeSize(t.dtype));
    }
  }
  if (size < 0 && state_names) {
    size_t p, g;
    std::string st;
    std::vector<int64_t> shape;
    absl::Status s = ResolveStateName(name, &p, &g, &st, &shape);
    if (!s.ok() && !absl::IsNotFound(s)) return s;
    if (s.ok()) size = 4 * NumElements(shape);
  }
  if (size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", Bounded(name), "'"));
  }
  if (offset < 0 || offset > size || len > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of '", Bounded(name), "' at offset ",
                                                   offset, " with ", len,
                                                   " bytes runs past its end (", size,
                                                   " bytes)"));
  }
  if (offset % elem != 0 || len % elem != 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of '", Bounded(name), "' at offset ",
                                                   offset, " with ", len,
                                                   " bytes is not aligned to its ", elem,
                                                   "-byte elements"));
  }
  *tensor_bytes = size;
  return absl::OkStatus();
}

absl::Status Session::CheckStreamChunk(StreamKind kind, const std::string& name, int64_t offset,
                                       int64_t len) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  if (kind == StreamKind::kGradients && absl::StrContains(name, "/state.")) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushGradients takes parameter names, not state '", Bounded(name), "'"));
  }
  int64_t size = 0;
  return CheckWriteLocked(name, offset, len, kind == StreamKind::kState, &size);
}

int64_t Session::StreamBytesLimit(StreamKind kind) {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    bytes += layout_.tensors[i].size_bytes;
    if (kind != StreamKind::kState) continue;
    const Group& g = groups_[group_of_param_[i]];
    if (g.optimizer == nullptr) continue;
    for (const std::string& st : g.optimizer->StateNames()) {
      auto shape = g.optimizer->StateShape(slot_in_group_[i], st);
      if (shape.ok()) bytes += 4 * NumElements(*shape);
    }
  }
  return bytes;
}

absl::Status Session::ValidateWrites(const std::vector<TensorWrite>& writes, bool state_names,
                                     std::vector<std::pair<int, std::string>>* resolved) {
  // Coverage per tensor: sum of bytes written must equal its size, with no overlap (checked
  // by sorting the intervals).
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> spans;
  std::map<std::string, int64_t> sizes;
  for (const TensorWrite& w : writes) {
    const int64_t len = static_cast<int64_t>(w.data.size());
    int64_t size = 0;
    DIOND_RETURN_IF_ERROR(CheckWriteLocked(w.name, w.offset_bytes, len, state_names, &size));
    spans[w.name].push_back({w.offset_bytes, w.offset_bytes + len});
    sizes[w.name] = size;
  }
  for (auto& [name, v] : spans) {
    std::sort(v.begin(), v.end());
    int64_t covered = 0;
    for (const auto& [a, b] : v) {
      if (a != covered) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", Bounded(name), "' is ", a < covered ? "written twice" : "incomplete",
            " at byte ", std::min(a, covered), " (truncated or overlapping stream)"));
      }
      covered = b;
    }
    if (covered != sizes[name]) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", Bounded(name), "' is incomplete: ",
                                                     covered, " of ", sizes[name],
                                                     " bytes received (truncated stream)"));
    }
  }
  (void)resolved;
  return absl::OkStatus();
}

absl::Status Session::ApplyGradientWrites(const std::vector<TensorWrite>& writes) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  for (const TensorWrite& w : writes) {
    if (absl::StrContains(w.name, "/state.")) {
      return absl::InvalidArgumentError(
          absl::StrCat("PushGradients takes parameter names, not state '", Bounded(w.name), "'"));
    }
  }
  DIOND_RETURN_IF_ERROR(ValidateWrites(writes, /*state_names=*/false, nullptr));
  DIOND_RETURN_IF_ERROR(CheckRegions("PushGradients", Role::kGradients));
  DIOND_RETURN_IF_ERROR(EnsureHostArena(Role::kGradients));
  for (const TensorWrite& w : writes) {
    for (const TensorPlacement& t : layout_.tensors) {
      if (t.name == w.name) {
        std::memcpy(grads_.data + t.grad_offset + w.offset_bytes, w.data.data(), w.data.size());
      }
    }
  }
  // Only the gradients (which the trainer's truncation destroyed anyway) were written.
  return CheckRegions("PushGradients", Role::kGradients);
}

absl::Status Session::ApplyStateWrites(const std::vector<TensorWrite>& writes) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(ValidateWrites(writes, /*state_names=*/true, nullptr));
  // Assemble whole tensors, then reuse SetState's path (fp32 state; params in trainer dtype).
  std::map<std::string, std::string> whole;
  for (const TensorWrite& w : writes) {
    std::string& buf = whole[w.name];
    if (buf.size() < static_cast<size_t>(w.offset_bytes) + w.data.size()) {
      buf.resize(static_cast<size_t>(w.offset_bytes) + w.data.size());
    }
    std::memcpy(buf.data() + w.offset_bytes, w.data.data(), w.data.size());
  }
  std::vector<NamedTensor> tensors;
  for (auto& [name, bytes] : whole) {
    NamedTensor t;
    t.name = name;
    bool is_param = false;
    for (const TensorPlacement& p : layout_.tensors) {
      if (p.name == name) {
        is_param = true;
        t.shape = p.shape;
        t.data.resize(static_cast<size_t>(p.numel));
        WidenToF32(p.dtype, reinterpret_cast<const uint8_t*>(bytes.data()), p.numel,
                   t.data.data());
      }
    }
    if (!is_param) {
      t.data.resize(bytes.size() / 4);
      std::memcpy(t.data.data(), bytes.data(), bytes.size());
    }
    tensors.push_back(std::move(t));
  }
  return SetStateLocked(tensors);
}

absl::Status Session::ReadParameterBytes(const std::string& name, int64_t offset, int64_t len,
                                         std::string* out) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  if (!params_.bound() && pending_params_.empty()) {
    return absl::FailedPreconditionError("no parameters are held yet (register or SetState)");
  }
  DIOND_RETURN_IF_ERROR(EnsureHostArena(Role::kParameters));
  for (const TensorPlacement& t : layout_.tensors) {
    if (t.name != name) continue;
    if (offset < 0 || len < 0 || offset > t.size_bytes || len > t.size_bytes - offset) {
      return absl::OutOfRangeError(absl::StrCat("read of '", Bounded(name), "' [", offset, ", +",
                                                len, ") is outside its ", t.size_bytes,
                                                " bytes"));
    }
    DIOND_RETURN_IF_ERROR(CheckRegions("PullParameters", Role::kParameters));
    out->assign(reinterpret_cast<const char*>(params_.data + t.param_offset + offset),
                static_cast<size_t>(len));
    return CheckRegions("PullParameters", Role::kParameters);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown parameter '", Bounded(name), "'"));
}

absl::StatusOr<std::vector<NamedTensor>> Session::GetState(bool include_parameters) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  return GetStateLocked(include_parameters);
}

absl::StatusOr<std::vector<NamedTensor>> Session::GetStateLocked(bool include_parameters) {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    if (include_parameters) {
      if (!params_.bound() && pending_params_.empty()) {
        return absl::FailedPreconditionError(
            "parameters requested but none are held yet (register or SetState)");
      }
      NamedTensor p;
      p.name = t.name;
      p.shape = t.shape;
      p.data.resize(static_cast<size_t>(t.numel));
      ReadParamF32(i, p.data.data());
      DIOND_RETURN_IF_ERROR(CheckRegions("reading the parameters", Role::kParameters));
      out.push_back(std::move(p));
    }
    const Group& g = groups_[group_of_param_[i]];
    // A world session holds only the state of the parameters this rank owns.
    if (g.optimizer->StateReleased(slot_in_group_[i])) continue;
    for (const std::string& st : g.optimizer->StateNames()) {
      DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape,
                             g.optimizer->StateShape(slot_in_group_[i], st));
      NamedTensor s;
      s.name = absl::StrCat(t.name, "/state.", st);
      s.shape = shape;
      s.data.resize(static_cast<size_t>(NumElements(shape)));
      DIOND_RETURN_IF_ERROR(
          g.optimizer->GetState(slot_in_group_[i], st, absl::MakeSpan(s.data)));
      out.push_back(std::move(s));
    }
  }
  return out;
}

absl::Status Session::SetState(const std::vector<NamedTensor>& tensors) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  return SetStateLocked(tensors);
}

absl::Status Session::SetStateLocked(const std::vector<NamedTensor>& tensors) {
  // Validate every tensor before writing any.
  std::set<std::string> seen;
  for (const NamedTensor& t : tensors) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", Bounded(t.name), "' given twice"));
    }
    int64_t want = -1;
    for (const TensorPlacement& p : layout_.tensors) {
      if (p.name == t.name) want = p.numel;
    }
    if (want < 0) {
      size_t p, g;
      std::string st;
      std::vector<int64_t> shape;
      absl::Status s = ResolveStateName(t.name, &p, &g, &st, &shape);
      if (absl::IsNotFound(s)) {
        return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", Bounded(t.name), "'"));
      }
      DIOND_RETURN_IF_ERROR(s);
      want = NumElements(shape);
    }
    if (static_cast<int64_t>(t.data.size()) != want) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", Bounded(t.name), "' has ",
                                                     t.data.size(), " values; expected ", want));
    }
  }
  // Parameters first, into the trainer's memory: the only writes that can meet a truncated
  // segment, so a failure there leaves the optimizer state and the master weights alone.
  std::vector<std::pair<size_t, const NamedTensor*>> param_writes;
  for (const NamedTensor& t : tensors) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      if (layout_.tensors[i].name == t.name) param_writes.push_back({i, &t});
    }
  }
  if (!param_writes.empty() && pending_params_.empty()) {
    DIOND_RETURN_IF_ERROR(CheckRegions("SetState", Role::kParameters));
    DIOND_RETURN_IF_ERROR(EnsureHostArena(Role::kParameters));
    for (const auto& [i, t] : param_writes) {
      const TensorPlacement& p = layout_.tensors[i];
      NarrowFromF32(p.dtype, t->data.data(), p.numel, params_.data + p.param_offset);
    }
    DIOND_RETURN_IF_ERROR(CheckRegions("SetState", Role::kParameters));
  }
  for (const auto& [i, t] : param_writes) {
    if (!pending_params_.empty()) {
      pending_params_[i] = t->data;
    } else if (!master_.empty() && !master_[i].empty()) {
      master_[i] = t->data;
    }
  }
  for (const NamedTensor& t : tensors) {
    bool is_param = false;
    for (const TensorPlacement& p : layout_.tensors) is_param = is_param || p.name == t.name;
    if (is_param) continue;
    size_t p, g;
    std::string st;
    std::vector<int64_t> shape;
    DIOND_RETURN_IF_ERROR(ResolveStateName(t.name, &p, &g, &st, &shape));
    // World sessions: every trainer may send the whole state; each rank keeps its owned share
    // (the owner of this parameter keeps this tensor).
    if (groups_[g].optimizer->StateReleased(slot_in_group_[p])) continue;
    DIOND_RETURN_IF_ERROR(groups_[g].optimizer->SetState(slot_in_group_[p], st, t.data));
  }
  return absl::OkStatus();
}

absl::Status Session::SetGroupHyperparameters(const std::string& group, std::optional<double> lr,
                                              std::optional<double> weight_decay) {
  // The same rule as CreateSession (optim::ValidateGroup).
  if (lr.has_value()) {
    DIOND_RETURN_IF_ERROR(optim::CheckStepKnob("lr", *lr, optim::kMaxLr));
  }
  if (weight_decay.has_value()) {
    DIOND_RETURN_IF_ERROR(
        optim::CheckStepKnob("weight_decay", *weight_decay, optim::kMaxWeightDecay));
  }
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  for (Group& g : groups_) {
    if (g.name != group) continue;
    if (lr.has_value()) g.lr = lr;
    if (weight_decay.has_value()) g.weight_decay = weight_decay;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown group '", Bounded(group), "'"));
}

absl::StatusOr<SessionSnapshot> Session::Snapshot() {
  absl::MutexLock lock(&mu_);
  SessionSnapshot snap;
  snap.spec = spec_;
  for (size_t g = 0; g < groups_.size(); ++g) {
    // Fold SetHyperparameters overrides into the saved config.
    if (groups_[g].lr) snap.spec.groups[g].config.hyperparams.lr = *groups_[g].lr;
    if (groups_[g].weight_decay) {
      snap.spec.groups[g].config.hyperparams.weight_decay = *groups_[g].weight_decay;
    }
  }
  snap.session_id = id_;
  snap.last_step_index = last_step_index_;
  if (last_result_.has_value() && last_result_->step_index == last_step_index_) {
    snap.last_result = last_result_;
  }
  DIOND_ASSIGN_OR_RETURN(snap.tensors, GetStateLocked(/*include_parameters=*/true));
  return snap;
}

absl::Status Session::Restore(const SessionSnapshot& snapshot) {
  absl::MutexLock lock(&mu_);
  // What the spec implies: every parameter and every state tensor this session holds (a world
  // session: those of its owned parameters), each with its exact shape.
  // State tensors of parameters another rank owns may be present (elastic restore: the old
  // ranks' checkpoints merged) and are skipped after their shape is checked.
  std::map<std::string, std::vector<int64_t>> expected, other_ranks;
  std::map<std::string, size_t> param_index;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    expected[t.name] = t.shape;
    param_index[t.name] = i;
    const Group& g = groups_[group_of_param_[i]];
    if (g.optimizer == nullptr) continue;
    const bool released = g.optimizer->StateReleased(slot_in_group_[i]);
    for (const std::string& st : g.optimizer->StateNames()) {
      DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape,
                             g.optimizer->StateShape(slot_in_group_[i], st));
      (released ? other_ranks : expected)[absl::StrCat(t.name, "/state.", st)] = shape;
    }
  }
  auto shape_text = [](const std::vector<int64_t>& s) {
    return absl::StrCat("[", absl::StrJoin(s, ","), "]");
  };
  std::vector<NamedTensor> state;
  std::vector<std::vector<float>> params(layout_.tensors.size());
  std::set<std::string> seen;
  for (const NamedTensor& t : snapshot.tensors) {
    auto it = expected.find(t.name);
    if (it == expected.end()) {
      auto other = other_ranks.find(t.name);
      if (other != other_ranks.end()) {
        if (t.shape != other->second) {
          return absl::DataLossError(absl::StrCat("checkpoint tensor '", Bounded(t.name), "' has shape ",
                                                  shape_text(t.shape), "; the spec implies ",
                                                  shape_text(other->second)));
        }
        continue;  // another rank's share
      }
      return absl::DataLossError(absl::StrCat(
          "checkpoint tensor '", t.name.substr(0, 200),
          "' is not a parameter or state tensor of the session's spec"));
    }
    if (!seen.insert(t.name).second) {
      return absl::DataLossError(absl::StrCat("checkpoint tensor '", Bounded(t.name), "' appears twice"));
    }
    if (t.shape != it->second || static_cast<int64_t>(t.data.size()) != NumElements(it->second)) {
      return absl::DataLossError(absl::StrCat("checkpoint tensor '", Bounded(t.name), "' has shape ",
                                              shape_text(t.shape), "; the spec implies ",
                                              shape_text(it->second)));
    }
    auto p = param_index.find(t.name);
    if (p != param_index.end()) {
      params[p->second] = t.data;
    } else {
      state.push_back(t);
    }
  }
  for (const auto& [name, shape] : expected) {
    if (!seen.count(name)) {
      return absl::DataLossError(absl::StrCat("checkpoint lacks tensor '", name, "' (shape ",
                                              shape_text(shape), ") that the spec implies"));
    }
  }
  if (absl::Status s = SetStateLocked(state); !s.ok()) {
    return absl::DataLossError(s.message());
  }
  pending_params_ = std::move(params);
  if (params_.bound()) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) WriteParamF32(i, pending_params_[i].data());
    pending_params_.clear();
    master_valid_ = !master_.empty();
  }
  last_step_index_ = snapshot.last_step_index;
  last_result_.reset();
  if (snapshot.last_result.has_value() &&
      snapshot.last_result->step_index == snapshot.last_step_index) {
    last_result_ = snapshot.last_result;
  }
  return absl::OkStatus();
}

void Session::DetachTrainer() {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  if (params_.region != nullptr) {
    // The weights the daemon holds now (master weights where kept) wait for the new trainer's
    // PARAMETERS region.
    std::vector<std::vector<float>> keep(layout_.tensors.size());
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      keep[i].resize(static_cast<size_t>(layout_.tensors[i].numel));
      ReadParamF32(i, keep[i].data());
    }
    params_ = Binding();
    pending_params_ = std::move(keep);
  }
  if (grads_.region != nullptr) grads_ = Binding();
}

SessionInfo Session::Info() {
  absl::MutexLock lock(&mu_);
  SessionInfo info;
  info.id = id_;
  info.client_name = spec_.client_name;
  info.owner = spec_.owner;
  info.session_name = spec_.session_name;
  info.parameters = static_cast<int64_t>(layout_.tensors.size());
  info.last_step_index = last_step_index_;
  info.state_bytes = state_bytes_.load();
  info.host_bytes = static_cast<int64_t>(params_.host.size() + grads_.host.size());
  for (const auto* scratch : {&grad_scratch_, &param_scratch_}) {
    for (const std::vector<float>& v : *scratch) {
      info.host_bytes += 4 * static_cast<int64_t>(v.capacity());
    }
  }
  info.last_used = last_used_;
  for (const GroupSpec& g : spec_.groups) {
    info.groups.push_back({g.name, g.config.algorithm, 0});
  }
  for (const ParamSpec& p : spec_.params) {
    for (SessionInfo::Group& g : info.groups) {
      if (g.name == p.group) ++g.parameters;
    }
  }
  info.world_key = spec_.world_key;
  info.last_step_time = last_step_time_;
  info.last_checkpoint_step = last_checkpoint_step_;
  info.last_checkpoint_path = last_checkpoint_path_;
  info.last_checkpoint_time = last_checkpoint_time_;
  return info;
}

void Session::RecordStepTime(absl::Time when) {
  absl::MutexLock lock(&mu_);
  last_step_time_ = when;
}

void Session::RecordCheckpoint(int64_t step, std::string path, absl::Time when) {
  absl::MutexLock lock(&mu_);
  last_checkpoint_step_ = step;
  last_checkpoint_path_ = std::move(path);
  last_checkpoint_time_ = when;
}

absl::Time Session::last_used() {
  absl::MutexLock lock(&mu_);
  return last_used_;
}

int64_t Session::last_step_index() {
  absl::MutexLock lock(&mu_);
  return last_step_index_;
}

}  // namespace diond::session

// ---- world sessions (docs/DISTRIBUTED.md) -------------------------------------------------------

namespace diond::session {

void Session::AttachWorld(std::shared_ptr<WorldLink> world, ShardPlan plan, uint64_t epoch,
                          absl::Duration verdict_wait, int64_t checksum_every) {
  absl::MutexLock lock(&mu_);
  WorldPart w;
  w.rank = world != nullptr ? world->rank() : 0;
  w.world = std::move(world);
  w.verdict_wait = verdict_wait;
  w.checksum_every = checksum_every;
  w.epoch = epoch;
  w.owned.resize(static_cast<size_t>(plan.world_size));
  w.owned_elements.assign(static_cast<size_t>(plan.world_size), 0);
  w.owned_payload.assign(static_cast<size_t>(plan.world_size), 0);
  w.compact.assign(plan.owner.size(), 0);
  w.replicated.assign(plan.owner.size(), false);
  for (size_t i = 0; i < plan.owner.size(); ++i) {
    const size_t j = static_cast<size_t>(plan.owner[i]);
    const Group& g = groups_[group_of_param_[i]];
    if (spec_.gradient_sync == GradientSync::kDionCompressed && g.optimizer != nullptr &&
        g.optimizer->config().algorithm == optim::AlgorithmKind::kDion) {
      w.replicated[i] = true;  // every rank steps it (compressed sync), nobody owns it
      continue;
    }
    if (g.optimizer != nullptr) {
      w.compact[i] = optim::CapturedUpdateSize(g.optimizer->config(), layout_.tensors[i].shape);
    }
    w.owned[j].push_back(i);
    w.owned_elements[j] += layout_.tensors[i].numel;
    w.owned_payload[j] += w.compact[i] > 0 ? w.compact[i] : layout_.tensors[i].numel;
  }
  // Shard the optimizer state: each rank keeps the state of what it owns (and of what every
  // rank steps, the compressed-sync Dion matrices); the rest is freed.
  int64_t bytes = 0;
  for (Group& g : groups_) {
    if (g.optimizer == nullptr) continue;
    std::vector<bool> keep(g.params.size());
    for (size_t slot = 0; slot < g.params.size(); ++slot) {
      const size_t i = g.params[slot];
      keep[slot] = w.replicated[i] || plan.owner[i] == w.rank;
    }
    absl::Status released = g.optimizer->ReleaseState(keep);
    DIOND_CHECK(released.ok()) << released;  // keep has one entry per parameter by construction
    bytes += 4 * g.optimizer->StateFloats();
  }
  for (const auto& m : master_) bytes += 4 * static_cast<int64_t>(m.size());
  state_bytes_.store(bytes);
  w.plan = std::move(plan);
  world_ = std::move(w);
}

absl::StatusOr<int64_t> Session::CheckReplicas(comm::Communicator* comm, int64_t step,
                                               const std::vector<float*>& params) {
  const WorldPart& w = *world_;
  const size_t n = layout_.tensors.size();
  const int world_size = w.plan.world_size;
  std::vector<uint64_t> mine(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 over the fp32 bytes
    const auto* p = reinterpret_cast<const uint8_t*>(params[i]);
    for (int64_t b = 0; b < layout_.tensors[i].numel * 4; ++b) {
      h ^= p[b];
      h *= 0x100000001b3ull;
    }
    mine[i] = h;
  }
  std::vector<uint64_t> all(n * static_cast<size_t>(world_size));
  DIOND_RETURN_IF_ERROR(comm->AllGatherBytes(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(mine.data()), n * 8),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(all.data()), all.size() * 8)));
  int64_t healed = 0;
  for (size_t i = 0; i < n; ++i) {
    const int owner = w.plan.owner[i];
    const uint64_t want = all[static_cast<size_t>(owner) * n + i];
    std::vector<int> differ;
    for (int r = 0; r < world_size; ++r) {
      if (all[static_cast<size_t>(r) * n + i] != want) differ.push_back(r);
    }
    if (differ.empty()) continue;
    // Every rank saw the same checksums, so every rank takes part in the same broadcasts.
    DIOND_LOG(WARNING) << "world session '" << spec_.world_key << "', step " << step
                       << ": parameter '" << layout_.tensors[i].name << "' differs on rank(s) "
                       << absl::StrJoin(differ, ", ") << " from its owner (rank " << owner
                       << "); replacing it with the owner's copy";
    DIOND_RETURN_IF_ERROR(comm->Broadcast(
        absl::MakeSpan(params[i], static_cast<size_t>(layout_.tensors[i].numel)), owner));
    for (int r : differ) healed += r == w.rank ? 1 : 0;
  }
  return healed;
}

std::string Session::DescribeWorldFailure(const absl::Status& why) {
  const WorldPart& w = *world_;
  std::string text(why.message());
  if (w.world == nullptr) return text;
  const absl::Time deadline = absl::Now() + w.verdict_wait;
  while (true) {
    comm::MembershipView v;
    if (!w.world->With([&](comm::World& world) { v = world.membership(); })) {
      return absl::StrCat(text, " (the daemon is shutting down)");
    }
    std::vector<std::string> lost;
    for (const comm::MemberInfo& m : v.members) {
      if (!m.live) lost.push_back(absl::StrCat("rank ", m.rank, " (", m.address, ")"));
    }
    if (!lost.empty()) {
      // The coordinator's reason names the rank already ("rank 2 (10.0.0.7) lost: ...").
      return absl::StrCat(v.broken_reason.empty() ? absl::StrCat(absl::StrJoin(lost, ", "), " lost")
                                                  : v.broken_reason,
                          " [", text, "]");
    }
    if (absl::Now() >= deadline) return text;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::StatusOr<StepResult> Session::WorldStepLocked(const StepRequest& request,
                                                    const kernels::Context& ctx,
                                                    absl::Mutex* compute_mu, absl::Time start) {
  WorldPart& w = *world_;
  const int world_size = w.plan.world_size;
  const std::string where =
      absl::StrCat("world session '", Bounded(spec_.world_key), "' (rank ", w.rank, " of ", world_size,
                   "), step ", request.step_index, ": ");
  if (!w.broken.ok()) return w.broken;
  std::shared_ptr<comm::Communicator> comm;
  if (w.world != nullptr) {
    absl::StatusOr<std::shared_ptr<comm::Communicator>> c =
        absl::UnavailableError("the daemon is shutting down");
    uint64_t epoch = 0;
    w.world->With([&](comm::World& world) {
      c = world.communicator();
      epoch = world.epoch();
    });
    if (!c.ok()) {
      return absl::UnavailableError(absl::StrCat(where, c.status().message()));
    }
    if (epoch != w.epoch) {
      w.broken = absl::UnavailableError(absl::StrCat(
          where, "the daemon world was rebuilt (generation ", w.epoch, " -> ", epoch,
          ") since this session was created; create it again and resume from the last "
          "checkpoint"));
      return w.broken;
    }
    comm = *std::move(c);
    comm->TakeBytesSent();  // per-step accounting starts here
  }
  const double scale = request.gradient_scale == 0.0 ? 1.0 : request.gradient_scale;

  // Gradients as fp32 (as Step does): in place when daemon-owned f32 and unscaled. A region
  // found broken here fails this rank's step before any collective (the other ranks' steps then
  // fail on their collectives' timeout, and the world session must be created again).
  const size_t n = layout_.tensors.size();
  std::vector<std::vector<float>>& grad_copies = ScratchBuffers(&grad_scratch_);
  std::vector<const float*> grads(n);
  bool finite = GradientsF32(scale, &grad_copies, &grads);
  DIOND_RETURN_IF_ERROR(CheckRegions(std::string(absl::StripSuffix(where, ": ")).c_str()));
  // AVERAGE: reduce-scatter the local gradients to their owners. Block j of the input holds the
  // gradients of rank j's parameters, padded to the largest block, plus one slot with this
  // rank's non-finite flag, so every rank learns the same number of non-finite trainers.
  std::vector<float> averaged;
  if (spec_.gradient_sync != GradientSync::kReplicated && comm != nullptr) {
    int64_t block = 0;
    for (int64_t e : w.owned_elements) block = std::max(block, e);
    block += 1;
    std::vector<float> input(static_cast<size_t>(block) * world_size, 0.0f);
    for (int j = 0; j < world_size; ++j) {
      float* dst = input.data() + static_cast<size_t>(j) * block;
      for (size_t i : w.owned[j]) {
        std::memcpy(dst, grads[i], static_cast<size_t>(layout_.tensors[i].numel) * 4);
        dst += layout_.tensors[i].numel;
      }
      input[static_cast<size_t>(j + 1) * block - 1] = finite ? 0.0f : 1.0f;
    }
    averaged.resize(static_cast<size_t>(block));
    absl::Status st = comm->ReduceScatterSum(input, absl::MakeSpan(averaged));
    if (!st.ok()) {
      w.broken = absl::UnavailableError(absl::StrCat(
          where, "gradient reduce-scatter failed: ", DescribeWorldFailure(st),
          "; create the session again and resume from the last checkpoint"));
      return w.broken;
    }
    finite = averaged.back() == 0.0f;
    const float divisor = static_cast<float>(world_size);
    float* a = averaged.data();
    for (size_t i : w.owned[w.rank]) {
      for (int64_t e = 0; e < layout_.tensors[i].numel; ++e) a[e] /= divisor;
      grads[i] = a;
      a += layout_.tensors[i].numel;
    }
  }
  StepResult result;
  result.step_index = request.step_index;
  if (!finite) {
    // REPLICATED: every rank holds the same gradients, so every rank decides the same; AVERAGE:
    // the flags were summed with the gradients.
    if (spec_.non_finite == NonFinitePolicy::kError) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step_index, ": gradients contain NaN or Inf (non_finite_policy=ERROR)"));
    }
    result.skipped = true;
    if (comm != nullptr) result.world_bytes_sent = comm->TakeBytesSent();
    result.total_micros = absl::ToInt64Microseconds(absl::Now() - start);
    last_step_index_ = request.step_index;
    last_result_ = result;
    return result;
  }

  // Parameters as fp32 (as Step does).
  std::vector<std::vector<float>>& param_copies = ScratchBuffers(&param_scratch_);
  std::vector<float*> params(n);
  ParamsF32(&param_copies, &params);
  DIOND_RETURN_IF_ERROR(CheckRegions(std::string(absl::StripSuffix(where, ": ")).c_str()));
  // Per group: this rank's share of the squared update norm (its optimizer measures what it
  // changed; a group every rank steps, compressed Dion, is counted on rank 0 only).
  std::vector<double> update_sq(groups_.size(), 0.0);

  // Owners compute: each group's optimizer sees only this rank's parameters (the others get no
  // gradient, which leaves them and their state alone), on the single-process code path.
  absl::Status compute_status;
  const absl::Time compute_start = absl::Now();
  // Per group: this step's options (every rank resolves them alike) and the owner's compact
  // updates (Dion P/Q_new, Dion2 slices).
  std::vector<optim::StepOptions> group_opts(groups_.size());
  std::vector<optim::StepCapture> captures(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    auto it = request.lr_override.find(g.name);
    group_opts[gi].lr = it != request.lr_override.end() ? std::optional<double>(it->second) : g.lr;
    group_opts[gi].weight_decay = g.weight_decay;
    group_opts[gi].step = GroupStep(request, g.name);  // the reference's group step
  }
  {
    absl::MutexLock compute(compute_mu);
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      Group& g = groups_[gi];
      if (g.optimizer == nullptr) continue;
      std::vector<float*> gp;
      std::vector<const float*> gg;
      bool any = false, compressed = false;
      for (size_t i : g.params) {
        // Compressed Dion: every rank steps every matrix on its own gradients.
        const bool mine = w.replicated[i] || w.plan.owner[i] == w.rank;
        gp.push_back(params[i]);
        gg.push_back(mine ? grads[i] : nullptr);
        any = any || mine;
        compressed = compressed || w.replicated[i];
      }
      if (!any) continue;
      optim::StepOptions opts = group_opts[gi];
      if (comm != nullptr) opts.capture = &captures[gi];
      if (comm != nullptr && compressed) {
        comm::Communicator* c = comm.get();
        opts.replica_average = [c](absl::Span<float> v) { return c->AllReduceAverage(v); };
      }
      absl::Status s = g.optimizer->Step(ctx, gp, gg, opts);
      if (s.ok() && (!compressed || w.rank == 0)) {
        update_sq[gi] = g.optimizer->last_update_norm() * g.optimizer->last_update_norm();
      }
      if (!s.ok()) {
        compute_status = absl::Status(
          absl::IsUnavailable(s) ? absl::StatusCode::kUnavailable : s.code(),
          absl::StrCat("step ", request.step_index, ", group '", Bounded(g.name), "': ",
                       absl::IsUnavailable(s) ? DescribeWorldFailure(s) : std::string(s.message())));
        break;
      }
    }
  }
  result.compute_micros = absl::ToInt64Microseconds(absl::Now() - compute_start);

  // Exchange: every rank's updated owned parameters (fp32), plus one status value per rank, by
  // one all-gather-v; everyone writes them into its own arena.
  if (comm != nullptr) {
    // Block of rank j: its payloads, then per group its squared update norm as two floats
    // (hi, lo: a double to ~48 bits), then its status.
    const int64_t extra = 2 * static_cast<int64_t>(groups_.size()) + 1;
    std::vector<int64_t> counts(static_cast<size_t>(world_size));
    for (int j = 0; j < world_size; ++j) counts[j] = w.owned_payload[j] + extra;
    std::vector<float> mine;
    mine.reserve(static_cast<size_t>(counts[w.rank]));
    for (size_t i : w.owned[w.rank]) {
      if (w.compact[i] > 0) {
        const auto& payloads = captures[group_of_param_[i]].payload;
        const std::vector<float>* p =
            payloads.size() > slot_in_group_[i] ? &payloads[slot_in_group_[i]] : nullptr;
        if (p != nullptr && static_cast<int64_t>(p->size()) == w.compact[i]) {
          mine.insert(mine.end(), p->begin(), p->end());
        } else {
          // Only after a failed compute (reported through the status value below).
          mine.resize(mine.size() + static_cast<size_t>(w.compact[i]), 0.0f);
          if (compute_status.ok()) {
            compute_status = absl::InternalError(absl::StrCat(
                "no compact update captured for '", Bounded(layout_.tensors[i].name), "'"));
          }
        }
      } else {
        mine.insert(mine.end(), params[i], params[i] + layout_.tensors[i].numel);
      }
    }
    for (double sq : update_sq) {
      const float hi = static_cast<float>(sq);
      mine.push_back(hi);
      mine.push_back(static_cast<float>(sq - static_cast<double>(hi)));
    }
    mine.push_back(compute_status.ok() ? 0.0f : 1.0f);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    std::vector<float> all(static_cast<size_t>(total));
    absl::Status st = comm->AllGatherV(mine, counts, absl::MakeSpan(all));
    if (!st.ok()) {
      w.broken = absl::UnavailableError(absl::StrCat(
          where, "exchange of the updated parameters failed: ", DescribeWorldFailure(st),
          "; create the session again and resume from the last checkpoint"));
      return w.broken;
    }
    std::vector<int> failed;
    std::vector<std::pair<size_t, int64_t>> compact;  // (parameter, offset in `all`)
    int64_t at = 0;
    for (int j = 0; j < world_size; ++j) {
      for (size_t i : w.owned[j]) {
        const int64_t numel = layout_.tensors[i].numel;
        if (w.compact[i] > 0) {
          if (j != w.rank) compact.emplace_back(i, at);
          at += w.compact[i];
        } else {
          if (j != w.rank) std::memcpy(params[i], all.data() + at, static_cast<size_t>(numel) * 4);
          at += numel;
        }
      }
      for (size_t gi = 0; gi < groups_.size(); ++gi, at += 2) {
        if (j == 0) update_sq[gi] = 0;  // from here on: the world's sum
        update_sq[gi] += static_cast<double>(all[static_cast<size_t>(at)]) +
                         static_cast<double>(all[static_cast<size_t>(at) + 1]);
      }
      if (all[static_cast<size_t>(at)] != 0.0f && j != w.rank) failed.push_back(j);
      ++at;
    }
    // The others' compact updates, applied here through the rules' own code (bit-identical to
    // what their owners computed).
    if (failed.empty() && compute_status.ok() && !compact.empty()) {
      absl::MutexLock compute(compute_mu);
      for (const auto& [i, offset] : compact) {
        const size_t gi = group_of_param_[i];
        absl::Status s = optim::ApplyCapturedUpdate(
            ctx, groups_[gi].optimizer->config(), layout_.tensors[i].shape, group_opts[gi],
            absl::MakeConstSpan(all.data() + offset, static_cast<size_t>(w.compact[i])),
            params[i]);
        if (!s.ok()) {
          compute_status = absl::InternalError(absl::StrCat(
              "applying the compact update of '", Bounded(layout_.tensors[i].name), "' from rank ",
              w.plan.owner[i], ": ", s.message()));
          break;
        }
      }
    }
    if (compute_status.ok() && !failed.empty()) {
      compute_status = absl::InternalError(absl::StrCat(
          "step ", request.step_index, " failed on rank(s) ", absl::StrJoin(failed, ", "),
          " (see their logs)"));
    }
    if (compute_status.ok() && failed.empty() && w.checksum_every > 0 &&
        request.step_index % w.checksum_every == 0) {
      auto healed = CheckReplicas(comm.get(), request.step_index, params);
      if (!healed.ok()) {
        w.broken = absl::UnavailableError(absl::StrCat(
            where, "checksum comparison failed: ", DescribeWorldFailure(healed.status()),
            "; create the session again and resume from the last checkpoint"));
        return w.broken;
      }
      result.checksum_mismatches = *healed;
    }
    result.world_bytes_sent = comm->TakeBytesSent();
  }
  if (!compute_status.ok()) {
    // Some groups may have been applied on some ranks: the replicas can no longer be trusted.
    w.broken = absl::Status(compute_status.code(),
                            absl::StrCat(where, compute_status.message(),
                                         "; the world session must be created again"));
    return w.broken;
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].optimizer == nullptr) continue;
    result.update_norms[groups_[gi].name] = std::sqrt(update_sq[gi]);
  }
  result.total_micros = absl::ToInt64Microseconds(absl::Now() - start);
  DIOND_RETURN_IF_ERROR(WriteBackParams(params, result));
  return result;
}

absl::Status Session::SynchronizeForCheckpoint() {
  absl::MutexLock lock(&mu_);
  if (!world_.has_value() || world_->world == nullptr ||
      spec_.gradient_sync != GradientSync::kDionCompressed) {
    return absl::OkStatus();
  }
  WorldPart& w = *world_;
  if (!w.broken.ok()) return w.broken;
  absl::StatusOr<std::shared_ptr<comm::Communicator>> c =
      absl::UnavailableError("the daemon is shutting down");
  w.world->With([&](comm::World& world) { c = world.communicator(); });
  if (!c.ok()) {
    return absl::UnavailableError(absl::StrCat("world session '", spec_.world_key,
                                               "': momentum synchronization: ",
                                               c.status().message()));
  }
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (!w.replicated[i]) continue;
    Group& g = groups_[group_of_param_[i]];
    std::vector<float> m(static_cast<size_t>(layout_.tensors[i].numel));
    DIOND_RETURN_IF_ERROR(
        g.optimizer->GetState(slot_in_group_[i], optim::kStateMomentum, absl::MakeSpan(m)));
    absl::Status st = (*c)->AllReduceAverage(absl::MakeSpan(m));
    if (!st.ok()) {
      w.broken = absl::UnavailableError(absl::StrCat(
          "world session '", Bounded(spec_.world_key), "': momentum synchronization failed: ",
          st.message()));
      return w.broken;
    }
    DIOND_RETURN_IF_ERROR(g.optimizer->SetState(slot_in_group_[i], optim::kStateMomentum, m));
  }
  (*c)->TakeBytesSent();
  return absl::OkStatus();
}

}  // namespace diond::session
