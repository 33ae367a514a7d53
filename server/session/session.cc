// Session: creation from a spec, the group hyperparameters and the operator's view. The rest of
// the class lives by concern in session_regions.cc (registering the trainer's memory; the arenas
// themselves are arenas.h), session_step.cc (the step skeleton), session_world.cc (the world's
// phases) and session_state.cc (state and parameter transfer, snapshots).
#include "server/session/session.h"

#include <cctype>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/validation.h"
#include "server/session/layout.h"
#include "server/session/session_device.h"
#include "server/session/session_internal.h"
#include "server/session/step_memory.h"

namespace diond::session {

Session::Session() = default;

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::string id, SessionSpec spec,
                                                         const kernels::Context* ctx,
                                                         const kernels::DeviceRuntime* runtime,
                                                         ComputeThread* compute) {
  if (compute != nullptr && !compute->OnThread()) {
    // The state is allocated and initialized by the ops: on the compute thread.
    absl::StatusOr<std::unique_ptr<Session>> made = absl::InternalError("not run");
    compute->Run([&] { made = Create(std::move(id), std::move(spec), ctx, runtime, compute); });
    return made;
  }
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
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate parameter name '", Bounded(p.name), "'"));
    }
    if (!group_index.contains(p.group)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", Bounded(p.name), "' names unknown group '", Bounded(p.group), "'"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(spec.params));

  std::unique_ptr<Session> s(new Session);
  s->id_ = std::move(id);
  s->layout_ = std::move(layout);
  s->compute_ = compute;
  absl::MutexLock lock(&s->mu_);
  s->arenas_.Init(&s->layout_, compute, ctx != nullptr ? ctx->num_threads() : 0);
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
  // Where the state lives: a device session's update context (the device when the rules run
  // there, else a CPU context over host-addressable device staging), world sessions included
  // (their world phases exchange in device buffers, session_world.cc); otherwise `ctx`'s device.
  const bool on_device = ctx != nullptr && ctx->device().type != kernels::DeviceType::kCpu;
  const kernels::DeviceRuntime no_runtime;
  if (on_device) {
    DIOND_ASSIGN_OR_RETURN(s->device_,
                           DeviceSide::Make(*s, *ctx, runtime != nullptr ? *runtime : no_runtime));
    s->memory_ = s->device_.get();
    s->arenas_.SetDeviceContext(s->device_->ctx.get());
  } else {
    s->host_memory_ = std::make_unique<HostMemory>();
    s->memory_ = s->host_memory_.get();
  }
  const kernels::Context* state_ctx = s->device_ != nullptr ? &s->device_->update_ctx() : ctx;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    Group& group = s->groups_[g];
    if (group.params.empty()) continue;  // declared but unused: nothing to optimize
    std::vector<optim::ParamShape> shapes;
    for (size_t i : group.params) shapes.push_back(spec.params[i].shape);
    auto opt = state_ctx != nullptr
                   ? optim::CreateGroupOptimizer(*state_ctx, spec.groups[g].config, shapes)
                   : optim::CreateGroupOptimizer(spec.groups[g].config, shapes);
    if (!opt.ok()) {
      const std::string pool =
          absl::IsResourceExhausted(opt.status()) ? s->DeviceAllocationError() : "";
      return absl::Status(
          opt.status().code(),
          absl::StrCat("group '", Bounded(group.name), "': ", opt.status().message(),
                       pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
    }
    group.optimizer = std::move(*opt);
    for (size_t slot = 0; slot < group.params.size(); ++slot) {
      for (const std::string& st : group.optimizer->StateNames()) {
        auto shape = group.optimizer->StateShape(slot, st);
        if (shape.ok()) s->state_bytes_ += 4 * internal::NumElements(*shape);
      }
    }
  }
  if (spec.fp32_master_weights) {
    s->master_bytes_ = s->arenas_.InitMaster(spec.params);
    s->state_bytes_ += s->master_bytes_;
    // A device session keeps them on its device, with the rest of its optimizer state.
    if (s->device_ != nullptr) {
      DIOND_RETURN_IF_ERROR(
          s->arenas_.MoveMasterToDevice([&] { return s->DeviceAllocationError(); }));
    }
  }
  s->spec_ = std::move(spec);
  s->last_used_ = absl::Now();
  return s;
}

const kernels::Context& Session::StateContext() {
  return device_ != nullptr ? device_->update_ctx() : arenas_.HostContext();
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
  DIOND_RETURN_IF_ERROR(queue_.Refuse("SetHyperparameters"));
  for (Group& g : groups_) {
    if (g.name != group) continue;
    if (lr.has_value()) g.lr = lr;
    if (weight_decay.has_value()) g.weight_decay = weight_decay;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown group '", Bounded(group), "'"));
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
  info.budget_bytes = BudgetBytes();
  info.host_bytes = arenas_.HostBytes();
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

bool Session::HoldsParameters() {
  absl::MutexLock lock(&mu_);
  return arenas_.HoldsParameters();
}

}  // namespace diond::session
