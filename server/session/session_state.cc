// State transfer: stream writes (PushGradients, SetState chunks), parameter reads
// (PullParameters), Get/SetState, and the snapshot/restore of a checkpoint.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace diond::session {

// The state transfer's helpers: only this file uses them.
struct Session::StateIo {
  // "<param>" or "<param>/state.<name>": the parameter, its group and the state's shape.
  static absl::Status ResolveStateName(Session& self, const std::string& name, size_t* param,
                                       size_t* group, std::string* state,
                                       std::vector<int64_t>* shape);
  // One write's name, range and alignment; `tensor_bytes`: the tensor's size.
  static absl::Status CheckWriteLocked(Session& self, const std::string& name, int64_t offset,
                                       int64_t len, bool state_names, int64_t* tensor_bytes);
  static absl::Status ValidateWrites(Session& self, const std::vector<TensorWrite>& writes,
                                     bool state_names);
  static absl::StatusOr<std::vector<NamedTensor>> GetStateLocked(Session& self,
                                                                 bool include_parameters);
  static absl::Status SetStateLocked(Session& self, const std::vector<NamedTensor>& tensors);
};

absl::Status Session::StateIo::ResolveStateName(Session& self, const std::string& name,
                                                size_t* param, size_t* group, std::string* state,
                                                std::vector<int64_t>* shape) {
  size_t pos = name.rfind("/state.");
  if (pos == std::string::npos) return absl::NotFoundError("not a state name");
  std::string pname = name.substr(0, pos);
  *state = name.substr(pos + 7);
  for (size_t i = 0; i < self.layout_.tensors.size(); ++i) {
    if (self.layout_.tensors[i].name != pname) continue;
    *param = i;
    *group = self.group_of_param_[i];
    const Group& g = self.groups_[*group];
    auto s = g.optimizer->StateShape(self.slot_in_group_[i], *state);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown state '", Bounded(name), "': group '", g.name, "' has state ",
                       absl::StrJoin(g.optimizer->StateNames(), ", ")));
    }
    *shape = *s;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("state '", Bounded(name), "' names unknown parameter '", Bounded(pname), "'"));
}

absl::Status Session::StateIo::CheckWriteLocked(Session& self, const std::string& name,
                                                int64_t offset, int64_t len, bool state_names,
                                                int64_t* tensor_bytes) {
  int64_t size = -1;
  int64_t elem = 4;
  for (const TensorPlacement& t : self.layout_.tensors) {
    if (t.name == name) {
      size = t.size_bytes;
      elem = static_cast<int64_t>(kernels::DTypeSize(t.dtype));
    }
  }
  if (size < 0 && state_names) {
    size_t p, g;
    std::string st;
    std::vector<int64_t> shape;
    absl::Status s = ResolveStateName(self, name, &p, &g, &st, &shape);
    if (!s.ok() && !absl::IsNotFound(s)) return s;
    if (s.ok()) size = 4 * internal::NumElements(shape);
  }
  if (size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", Bounded(name), "'"));
  }
  if (offset < 0 || offset > size || len > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of '", Bounded(name), "' at offset ",
                                                   offset, " with ", len,
                                                   " bytes runs past its end (", size, " bytes)"));
  }
  if (offset % elem != 0 || len % elem != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk of '", Bounded(name), "' at offset ", offset, " with ", len,
                     " bytes is not aligned to its ", elem, "-byte elements"));
  }
  *tensor_bytes = size;
  return absl::OkStatus();
}

absl::Status Session::CheckStreamChunk(StreamKind kind, const std::string& name, int64_t offset,
                                       int64_t len) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(
      queue_.Refuse(kind == StreamKind::kGradients ? "PushGradients" : "SetState"));
  if (kind == StreamKind::kGradients && absl::StrContains(name, "/state.")) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushGradients takes parameter names, not state '", Bounded(name), "'"));
  }
  int64_t size = 0;
  return StateIo::CheckWriteLocked(*this, name, offset, len, kind == StreamKind::kState, &size);
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
      if (shape.ok()) bytes += 4 * internal::NumElements(*shape);
    }
  }
  return bytes;
}

absl::Status Session::StateIo::ValidateWrites(Session& self, const std::vector<TensorWrite>& writes,
                                              bool state_names) {
  // Coverage per tensor: sum of bytes written must equal its size, with no overlap (checked
  // by sorting the intervals).
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> spans;
  std::map<std::string, int64_t> sizes;
  for (const TensorWrite& w : writes) {
    const int64_t len = static_cast<int64_t>(w.data.size());
    int64_t size = 0;
    DIOND_RETURN_IF_ERROR(CheckWriteLocked(self, w.name, w.offset_bytes, len, state_names, &size));
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
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", Bounded(name), "' is incomplete: ", covered, " of ", sizes[name],
                       " bytes received (truncated stream)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::ApplyGradientWrites(const std::vector<TensorWrite>& writes) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("PushGradients"));
  for (const TensorWrite& w : writes) {
    if (absl::StrContains(w.name, "/state.")) {
      return absl::InvalidArgumentError(
          absl::StrCat("PushGradients takes parameter names, not state '", Bounded(w.name), "'"));
    }
  }
  DIOND_RETURN_IF_ERROR(StateIo::ValidateWrites(*this, writes, /*state_names=*/false));
  DIOND_RETURN_IF_ERROR(arenas_.CheckRegions("PushGradients", Role::kGradients));
  DIOND_RETURN_IF_ERROR(arenas_.EnsureHostArena(Role::kGradients));
  Arenas::Binding& grads = arenas_.grads();
  for (const TensorWrite& w : writes) {
    for (const TensorPlacement& t : layout_.tensors) {
      if (t.name == w.name) {
        std::memcpy(grads.data + t.grad_offset + w.offset_bytes, w.data.data(), w.data.size());
      }
    }
  }
  // Only the gradients (which the trainer's truncation destroyed anyway) were written.
  return arenas_.CheckRegions("PushGradients", Role::kGradients);
}

absl::Status Session::ApplyStateWrites(const std::vector<TensorWrite>& writes) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("SetState"));
  DIOND_RETURN_IF_ERROR(StateIo::ValidateWrites(*this, writes, /*state_names=*/true));
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
        const uint8_t* src = reinterpret_cast<const uint8_t*>(bytes.data());
        RunOnCompute(compute_, [&] {
          internal::WidenToF32(arenas_.HostContext(), p.dtype, src, p.numel, t.data.data());
        });
      }
    }
    if (!is_param) {
      t.data.resize(bytes.size() / 4);
      std::memcpy(t.data.data(), bytes.data(), bytes.size());
    }
    tensors.push_back(std::move(t));
  }
  return StateIo::SetStateLocked(*this, tensors);
}

absl::Status Session::ReadParameterBytes(const std::string& name, int64_t offset, int64_t len,
                                         std::string* out) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("PullParameters"));
  if (!arenas_.HoldsParameters()) {
    return absl::FailedPreconditionError("no parameters are held yet (register or SetState)");
  }
  const Arenas::Binding& params = arenas_.params();
  if (params.cuda == nullptr) DIOND_RETURN_IF_ERROR(arenas_.EnsureHostArena(Role::kParameters));
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    if (t.name != name) continue;
    if (offset < 0 || len < 0 || offset > t.size_bytes || len > t.size_bytes - offset) {
      return absl::OutOfRangeError(absl::StrCat("read of '", Bounded(name), "' [", offset, ", +",
                                                len, ") is outside its ", t.size_bytes, " bytes"));
    }
    if (params.cuda != nullptr) {
      // A device session's CUDA region: the tensor's bytes through an explicit copy.
      std::vector<uint8_t> bytes;
      DIOND_RETURN_IF_ERROR(arenas_.CudaParamToHost(i, &bytes));
      out->assign(reinterpret_cast<const char*>(bytes.data()) + offset, static_cast<size_t>(len));
      return absl::OkStatus();
    }
    DIOND_RETURN_IF_ERROR(arenas_.CheckRegions("PullParameters", Role::kParameters));
    out->assign(reinterpret_cast<const char*>(params.data + t.param_offset + offset),
                static_cast<size_t>(len));
    return arenas_.CheckRegions("PullParameters", Role::kParameters);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown parameter '", Bounded(name), "'"));
}

absl::StatusOr<std::vector<NamedTensor>> Session::GetState(bool include_parameters) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("GetState"));
  return StateIo::GetStateLocked(*this, include_parameters);
}

absl::StatusOr<std::vector<NamedTensor>> Session::StateIo::GetStateLocked(Session& self,
                                                                          bool include_parameters) {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < self.layout_.tensors.size(); ++i) {
    const TensorPlacement& t = self.layout_.tensors[i];
    if (include_parameters) {
      if (!self.arenas_.HoldsParameters()) {
        return absl::FailedPreconditionError(
            "parameters requested but none are held yet (register or SetState)");
      }
      NamedTensor p;
      p.name = t.name;
      p.shape = t.shape;
      p.data.resize(static_cast<size_t>(t.numel));
      DIOND_RETURN_IF_ERROR(self.arenas_.ReadParamF32(i, p.data.data()));
      DIOND_RETURN_IF_ERROR(self.arenas_.CheckRegions("reading the parameters", Role::kParameters));
      out.push_back(std::move(p));
    }
    const Group& g = self.groups_[self.group_of_param_[i]];
    // A world session holds only the state of the parameters this rank owns.
    if (g.optimizer->StateReleased(self.slot_in_group_[i])) continue;
    for (const std::string& st : g.optimizer->StateNames()) {
      DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape,
                             g.optimizer->StateShape(self.slot_in_group_[i], st));
      NamedTensor s;
      s.name = absl::StrCat(t.name, "/state.", st);
      s.shape = shape;
      s.data.resize(static_cast<size_t>(internal::NumElements(shape)));
      DIOND_RETURN_IF_ERROR(CallOnCompute(self.compute_, [&] {
        return g.optimizer->GetState(self.StateContext(), self.slot_in_group_[i], st,
                                     absl::MakeSpan(s.data));
      }));
      out.push_back(std::move(s));
    }
  }
  return out;
}

absl::Status Session::SetState(const std::vector<NamedTensor>& tensors) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("SetState"));
  return StateIo::SetStateLocked(*this, tensors);
}

absl::Status Session::StateIo::SetStateLocked(Session& self,
                                              const std::vector<NamedTensor>& tensors) {
  // Validate every tensor before writing any.
  std::set<std::string> seen;
  for (const NamedTensor& t : tensors) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", Bounded(t.name), "' given twice"));
    }
    int64_t want = -1;
    for (const TensorPlacement& p : self.layout_.tensors) {
      if (p.name == t.name) want = p.numel;
    }
    if (want < 0) {
      size_t p, g;
      std::string st;
      std::vector<int64_t> shape;
      absl::Status s = ResolveStateName(self, t.name, &p, &g, &st, &shape);
      if (absl::IsNotFound(s)) {
        return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", Bounded(t.name), "'"));
      }
      DIOND_RETURN_IF_ERROR(s);
      want = internal::NumElements(shape);
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
    for (size_t i = 0; i < self.layout_.tensors.size(); ++i) {
      if (self.layout_.tensors[i].name == t.name) param_writes.push_back({i, &t});
    }
  }
  if (!param_writes.empty() && !self.arenas_.holding() && self.arenas_.params().cuda != nullptr) {
    // A device session's CUDA region: the new weights go in through its explicit copies.
    for (const auto& [i, t] : param_writes) {
      DIOND_RETURN_IF_ERROR(self.arenas_.WriteParamF32(i, t->data.data()));
    }
  } else if (!param_writes.empty() && !self.arenas_.holding()) {
    DIOND_RETURN_IF_ERROR(self.arenas_.CheckRegions("SetState", Role::kParameters));
    DIOND_RETURN_IF_ERROR(self.arenas_.EnsureHostArena(Role::kParameters));
    RunOnCompute(self.compute_, [&] {
      for (const auto& [i, t] : param_writes) {
        const TensorPlacement& p = self.layout_.tensors[i];
        internal::NarrowFromF32(self.arenas_.HostContext(), p.dtype, t->data.data(), p.numel,
                                self.arenas_.params().data + p.param_offset);
      }
    });
    DIOND_RETURN_IF_ERROR(self.arenas_.CheckRegions("SetState", Role::kParameters));
  }
  for (const auto& [i, t] : param_writes) {
    if (self.arenas_.holding()) {
      self.arenas_.held(i) = t->data;
    } else if (self.arenas_.HasMaster(i)) {
      DIOND_RETURN_IF_ERROR(self.arenas_.WriteMaster(i, t->data.data()));
    }
  }
  for (const NamedTensor& t : tensors) {
    bool is_param = false;
    for (const TensorPlacement& p : self.layout_.tensors) is_param = is_param || p.name == t.name;
    if (is_param) continue;
    size_t p, g;
    std::string st;
    std::vector<int64_t> shape;
    DIOND_RETURN_IF_ERROR(ResolveStateName(self, t.name, &p, &g, &st, &shape));
    // World sessions: every trainer may send the whole state; each rank keeps its owned share
    // (the owner of this parameter keeps this tensor).
    if (self.groups_[g].optimizer->StateReleased(self.slot_in_group_[p])) continue;
    DIOND_RETURN_IF_ERROR(CallOnCompute(self.compute_, [&] {
      return self.groups_[g].optimizer->SetState(self.StateContext(), self.slot_in_group_[p], st,
                                                 t.data);
    }));
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionSnapshot> Session::Snapshot() {
  absl::MutexLock lock(&mu_);
  // A queued asynchronous step first updates what the snapshot reads (its outcome stays to be
  // collected; the automatic checkpoint runs while it completes).
  queue_.Await(StepQueue::State::kCompleting);
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
  DIOND_ASSIGN_OR_RETURN(snap.tensors, StateIo::GetStateLocked(*this, /*include_parameters=*/true));
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
          return absl::DataLossError(
              absl::StrCat("checkpoint tensor '", Bounded(t.name), "' has shape ",
                           shape_text(t.shape), "; the spec implies ", shape_text(other->second)));
        }
        continue;  // another rank's share
      }
      return absl::DataLossError(
          absl::StrCat("checkpoint tensor '", t.name.substr(0, 200),
                       "' is not a parameter or state tensor of the session's spec"));
    }
    if (!seen.insert(t.name).second) {
      return absl::DataLossError(
          absl::StrCat("checkpoint tensor '", Bounded(t.name), "' appears twice"));
    }
    if (t.shape != it->second ||
        static_cast<int64_t>(t.data.size()) != internal::NumElements(it->second)) {
      return absl::DataLossError(absl::StrCat("checkpoint tensor '", Bounded(t.name),
                                              "' has shape ", shape_text(t.shape),
                                              "; the spec implies ", shape_text(it->second)));
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
  if (absl::Status s = StateIo::SetStateLocked(*this, state); !s.ok()) {
    return absl::DataLossError(s.message());
  }
  if (absl::Status s = arenas_.Hold(std::move(params)); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("restoring the parameters into the PARAMETERS region failed: ", s.message()));
  }
  last_step_index_ = snapshot.last_step_index;
  last_result_.reset();
  if (snapshot.last_result.has_value() &&
      snapshot.last_result->step_index == snapshot.last_step_index) {
    last_result_ = snapshot.last_result;
  }
  return absl::OkStatus();
}

}  // namespace diond::session
