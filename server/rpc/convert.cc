#include "server/rpc/convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/option_table.h"
#include "server/memory/doorbell.h"

namespace diond::rpc {
namespace {

absl::StatusOr<optim::AlgorithmKind> AlgorithmFromProto(int v, const std::string& group) {
  switch (v) {
    case v1::ALGORITHM_MUON:
      return optim::AlgorithmKind::kMuon;
    case v1::ALGORITHM_NORMUON:
      return optim::AlgorithmKind::kNorMuon;
    case v1::ALGORITHM_DION:
      return optim::AlgorithmKind::kDion;
    case v1::ALGORITHM_DION2:
      return optim::AlgorithmKind::kDion2;
    case v1::ALGORITHM_DION3:
      return optim::AlgorithmKind::kNorDion2;
    case v1::ALGORITHM_ADAMW:
      return optim::AlgorithmKind::kAdamW;
    case v1::ALGORITHM_LION:
      return optim::AlgorithmKind::kLion;
    default:
      return absl::InvalidArgumentError(absl::StrCat("group '", Bounded(group), "': algorithm ", v,
                                                     " is not a known Algorithm value"));
  }
}

// The field of diond.v1.Hyperparameters that `row` names. option_table_test checks that every
// row has its field, of the row's type, and every field its row.
const google::protobuf::FieldDescriptor* OptionField(const optim::OptionRow& row) {
  const google::protobuf::FieldDescriptor* f =
      v1::Hyperparameters::descriptor()->FindFieldByName(std::string(row.name));
  DIOND_CHECK(f != nullptr) << "option " << row.name << " has no field in Hyperparameters";
  return f;
}

absl::Status Finite(const char* name, double v) {
  if (!std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameter ", name, " = ", v, " is not finite"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<kernels::DType> DTypeFromProto(int value, absl::string_view field) {
  switch (value) {
    case v1::DTYPE_F32:
      return kernels::DType::kF32;
    case v1::DTYPE_BF16:
      return kernels::DType::kBf16;
    case v1::DTYPE_F16:
      return kernels::DType::kF16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": dtype ", value, " is not one of DTYPE_F32, DTYPE_BF16, DTYPE_F16"));
  }
}

v1::DType DTypeToProto(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return v1::DTYPE_F32;
    case kernels::DType::kBf16:
      return v1::DTYPE_BF16;
    case kernels::DType::kF16:
      return v1::DTYPE_F16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

v1::Algorithm AlgorithmToProto(optim::AlgorithmKind a) {
  switch (a) {
    case optim::AlgorithmKind::kMuon:
      return v1::ALGORITHM_MUON;
    case optim::AlgorithmKind::kNorMuon:
      return v1::ALGORITHM_NORMUON;
    case optim::AlgorithmKind::kDion:
      return v1::ALGORITHM_DION;
    case optim::AlgorithmKind::kDion2:
      return v1::ALGORITHM_DION2;
    case optim::AlgorithmKind::kNorDion2:
      return v1::ALGORITHM_DION3;
    case optim::AlgorithmKind::kAdamW:
      return v1::ALGORITHM_ADAMW;
    case optim::AlgorithmKind::kLion:
      return v1::ALGORITHM_LION;
  }
  return v1::ALGORITHM_UNSPECIFIED;
}

namespace {
int64_t UnixMicrosOrZero(absl::Time t) {
  return t == absl::InfinitePast() ? 0 : absl::ToUnixMicros(t);
}
}  // namespace

void SessionInfoToProto(const session::SessionInfo& info, absl::Time now, v1::SessionInfo* out) {
  out->set_session_id(info.id);
  out->set_owner(info.owner);
  out->set_session_name(info.session_name);
  out->set_client_name(info.client_name);
  out->set_parameters(info.parameters);
  out->set_last_step_index(info.last_step_index);
  out->set_state_bytes(info.state_bytes);
  for (const session::SessionInfo::Group& g : info.groups) {
    v1::SessionGroupInfo* pg = out->add_groups();
    pg->set_name(g.name);
    pg->set_algorithm(AlgorithmToProto(g.algorithm));
    pg->set_parameters(g.parameters);
  }
  out->set_host_bytes(info.host_bytes);
  out->set_last_step_unix_micros(UnixMicrosOrZero(info.last_step_time));
  out->set_last_used_unix_micros(UnixMicrosOrZero(info.last_used));
  out->set_world_key(info.world_key);
  out->set_last_checkpoint_step(info.last_checkpoint_step);
  out->set_last_checkpoint_path(info.last_checkpoint_path);
  out->set_last_checkpoint_unix_micros(UnixMicrosOrZero(info.last_checkpoint_time));
  if (info.last_step_time == absl::InfinitePast()) {
    out->set_state(v1::SESSION_STATE_NEW);
  } else if (now - info.last_used >= absl::Seconds(60)) {
    out->set_state(v1::SESSION_STATE_IDLE);
  } else {
    out->set_state(v1::SESSION_STATE_ACTIVE);
  }
}

absl::Status ApplyHyperparameters(const v1::Hyperparameters& h, optim::Hyperparams* result) {
  // Into a copy, so that a refused message changes nothing (found by hyperparameters_fuzz).
  optim::Hyperparams copy = *result;
  const google::protobuf::Reflection* reflection = h.GetReflection();
  for (const optim::OptionRow& row : optim::OptionTable()) {
    const google::protobuf::FieldDescriptor* f = OptionField(row);
    // Optional scalars: only the fields that are set; enums: UNSPECIFIED (0) keeps the default.
    if (row.type != optim::OptionType::kEnum && !reflection->HasField(h, f)) continue;
    optim::OptionValue v;
    switch (row.type) {
      case optim::OptionType::kDouble:
        v.number = reflection->GetDouble(h, f);
        DIOND_RETURN_IF_ERROR(Finite(f->name().c_str(), v.number));
        break;
      case optim::OptionType::kInt:
        v.integer = reflection->GetInt64(h, f);
        break;
      case optim::OptionType::kBool:
        v.integer = reflection->GetBool(h, f) ? 1 : 0;
        break;
      case optim::OptionType::kEnum: {
        const int e = reflection->GetEnumValue(h, f);
        if (e == 0) continue;
        if (e < 0 || e > static_cast<int>(row.enum_names.size())) {
          return absl::InvalidArgumentError(absl::StrCat(row.name, " ", e, " is unknown"));
        }
        v.integer = e - 1;
        break;
      }
    }
    row.set(copy, v);
  }
  *result = copy;
  return absl::OkStatus();
}

void HyperparametersToProto(const optim::Hyperparams& h, v1::Hyperparameters* out) {
  const google::protobuf::Reflection* reflection = out->GetReflection();
  for (const optim::OptionRow& row : optim::OptionTable()) {
    const google::protobuf::FieldDescriptor* f = OptionField(row);
    const optim::OptionValue v = row.get(h);
    switch (row.type) {
      case optim::OptionType::kDouble:
        reflection->SetDouble(out, f, v.number);
        break;
      case optim::OptionType::kInt:
        reflection->SetInt64(out, f, v.integer);
        break;
      case optim::OptionType::kBool:
        reflection->SetBool(out, f, v.integer != 0);
        break;
      case optim::OptionType::kEnum:
        reflection->SetEnumValue(out, f, static_cast<int>(v.integer) + 1);
        break;
    }
  }
}

absl::StatusOr<HyperparameterChange> HyperparameterChangeFromProto(
    const v1::SetHyperparametersRequest& req) {
  const v1::Hyperparameters& h = req.hyperparameters();
  // Only the step-size knobs change mid-session today; refusing the rest is better than
  // silently ignoring them.
  v1::Hyperparameters rest = h;
  rest.clear_lr();
  rest.clear_weight_decay();
  if (rest.ByteSizeLong() != 0) {
    return absl::InvalidArgumentError(
        "SetHyperparameters changes lr and weight_decay only; other fields are fixed at "
        "CreateSession");
  }
  HyperparameterChange c;
  c.group = req.group();
  if (h.has_lr()) c.lr = h.lr();
  if (h.has_weight_decay()) c.weight_decay = h.weight_decay();
  return c;
}

session::StepRequest StepRequestFromProto(const v1::StepRequest& req) {
  session::StepRequest sr;
  sr.step_index = req.step_index();
  sr.gradient_scale = req.gradient_scale();
  for (const auto& [group, lr] : req.lr_override()) sr.lr_override[group] = lr;
  for (const auto& [group, n] : req.group_step()) sr.group_step[group] = n;
  sr.asynchronous = req.asynchronous();
  sr.wait = req.wait();
  sr.ready_event = req.ready_event();
  sr.done_event = req.done_event();
  sr.params_without_grad.assign(req.params_without_grad().begin(), req.params_without_grad().end());
  sr.overlap = req.overlap();
  sr.max_grad_norm = req.max_grad_norm();
  return sr;
}

absl::StatusOr<std::vector<session::DoorbellBucket>> DoorbellBucketsFromProto(
    const v1::RegisterRegionRequest& req) {
  if (req.kind() != v1::REGION_KIND_SYSTEM_SHM && req.kind() != v1::REGION_KIND_MEMFD) {
    return absl::InvalidArgumentError(
        absl::StrCat("REGION_ROLE_DOORBELLS is a page of host memory: kind must be "
                     "REGION_KIND_SYSTEM_SHM or REGION_KIND_MEMFD, not ",
                     v1::RegionKind_Name(req.kind())));
  }
  if (req.kind() == v1::REGION_KIND_SYSTEM_SHM && !req.has_system_shm()) {
    return absl::InvalidArgumentError("REGION_KIND_SYSTEM_SHM needs system_shm");
  }
  if (req.kind() == v1::REGION_KIND_MEMFD && !req.has_memfd()) {
    return absl::InvalidArgumentError("REGION_KIND_MEMFD needs memfd");
  }
  // Bounded before anything is allocated for them (the session checks them against its
  // parameters and the page's header).
  if (req.buckets_size() < 1 || req.buckets_size() > memory::Doorbells::kMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat("REGION_ROLE_DOORBELLS declares ",
                                                   req.buckets_size(), " buckets; 1 to ",
                                                   memory::Doorbells::kMaxBuckets, " are allowed"));
  }
  std::vector<session::DoorbellBucket> buckets;
  buckets.reserve(static_cast<size_t>(req.buckets_size()));
  for (const v1::Bucket& b : req.buckets()) {
    buckets.push_back({{b.params().begin(), b.params().end()}, b.ready_event(), b.done_event()});
  }
  return buckets;
}

absl::StatusOr<session::Role> RegionRoleFromProto(const v1::RegisterRegionRequest& req) {
  if (req.buckets_size() > 0) {
    return absl::InvalidArgumentError("buckets are for REGION_ROLE_DOORBELLS only");
  }
  session::Role role;
  switch (req.role()) {
    case v1::REGION_ROLE_PARAMETERS:
      role = session::Role::kParameters;
      break;
    case v1::REGION_ROLE_GRADIENTS:
      role = session::Role::kGradients;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("role ", req.role(), " is not REGION_ROLE_PARAMETERS or GRADIENTS"));
  }
  switch (req.kind()) {
    case v1::REGION_KIND_SYSTEM_SHM:
      if (!req.has_system_shm()) {
        return absl::InvalidArgumentError("REGION_KIND_SYSTEM_SHM needs system_shm");
      }
      break;
    case v1::REGION_KIND_MEMFD:
      if (!req.has_memfd()) return absl::InvalidArgumentError("REGION_KIND_MEMFD needs memfd");
      break;
    case v1::REGION_KIND_CUDA_IPC:
    case v1::REGION_KIND_CUDA_VMM_FD:
      break;  // their fields are the service's check (a CPU daemon refuses them)
    default:
      return absl::InvalidArgumentError(absl::StrCat("region kind ", req.kind(), " is not known"));
  }
  return role;
}

absl::StatusOr<session::SessionSpec> SpecFromProto(const v1::CreateSessionRequest& req) {
  session::SessionSpec spec;
  switch (req.non_finite_policy()) {
    case v1::NON_FINITE_POLICY_UNSPECIFIED:
    case v1::NON_FINITE_POLICY_SKIP:
      spec.non_finite = session::NonFinitePolicy::kSkip;
      break;
    case v1::NON_FINITE_POLICY_ERROR:
      spec.non_finite = session::NonFinitePolicy::kError;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("non_finite_policy ", req.non_finite_policy(), " is unknown"));
  }
  switch (req.gradient_sync()) {
    case v1::GRADIENT_SYNC_UNSPECIFIED:
    case v1::GRADIENT_SYNC_REPLICATED:
      spec.gradient_sync = session::GradientSync::kReplicated;
      break;
    case v1::GRADIENT_SYNC_AVERAGE:
      spec.gradient_sync = session::GradientSync::kAverage;
      break;
    case v1::GRADIENT_SYNC_DION_COMPRESSED:
      spec.gradient_sync = session::GradientSync::kDionCompressed;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("gradient_sync ", req.gradient_sync(), " is unknown"));
  }
  if (spec.gradient_sync != session::GradientSync::kReplicated && req.world_key().empty()) {
    return absl::UnimplementedError(
        "gradient_sync AVERAGE and DION_COMPRESSED combine the gradients of a world session's "
        "trainers: set world_key (docs/DISTRIBUTED.md); a local session is REPLICATED");
  }
  spec.world_key = req.world_key();
  spec.fp32_master_weights = req.fp32_master_weights();
  spec.client_name = req.client_name();
  spec.session_name = req.session_name();
  for (const v1::ParameterGroup& g : req.groups()) {
    session::GroupSpec gs;
    gs.name = g.name();
    DIOND_ASSIGN_OR_RETURN(gs.config.algorithm, AlgorithmFromProto(g.algorithm(), g.name()));
    gs.config.hyperparams = optim::DefaultHyperparams(gs.config.algorithm);
    absl::Status s = ApplyHyperparameters(g.hyperparameters(), &gs.config.hyperparams);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", Bounded(g.name()), "': ", s.message()));
    }
    if (g.num_heads() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("group '", Bounded(g.name()), "': num_heads ",
                                                     g.num_heads(), " must be >= 0"));
    }
    gs.config.num_heads = g.num_heads() == 0 ? 1 : g.num_heads();
    gs.config.split_sizes.assign(g.split_sizes().begin(), g.split_sizes().end());
    gs.config.flatten = g.flatten();
    switch (g.precision()) {
      case v1::PRECISION_UNSPECIFIED:
      case v1::PRECISION_FP32:
        gs.config.precision = optim::Precision::kFp32;
        break;
      case v1::PRECISION_BF16_REFERENCE:
        gs.config.precision = optim::Precision::kBf16Reference;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "group '", Bounded(g.name()), "': precision ", g.precision(), " is unknown"));
    }
    switch (g.bf16_matmul()) {
      case v1::BF16_MATMUL_UNSPECIFIED:
      case v1::BF16_MATMUL_AUTO:
        gs.config.bf16_matmul = optim::Bf16MatmulEngine::kAuto;
        break;
      case v1::BF16_MATMUL_FLOAT32_GEMM:
        gs.config.bf16_matmul = optim::Bf16MatmulEngine::kFloat32Gemm;
        break;
      case v1::BF16_MATMUL_ONEDNN:
        gs.config.bf16_matmul = optim::Bf16MatmulEngine::kOneDnn;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "group '", Bounded(g.name()), "': bf16_matmul ", g.bf16_matmul(), " is unknown"));
    }
    gs.config.seed = g.seed();
    spec.groups.push_back(std::move(gs));
  }
  for (const v1::ParameterSpec& p : req.parameters()) {
    session::ParamSpec ps;
    ps.name = p.name();
    ps.shape.assign(p.shape().begin(), p.shape().end());
    DIOND_ASSIGN_OR_RETURN(
        ps.dtype, DTypeFromProto(p.dtype(), absl::StrCat("parameter '", Bounded(p.name()), "'")));
    ps.group = p.group();
    spec.params.push_back(std::move(ps));
  }
  return spec;
}

void LayoutToProto(const session::Session& s, v1::CreateSessionResponse* resp) {
  resp->set_session_id(s.id());
  for (const session::TensorPlacement& t : s.layout().tensors) {
    v1::TensorLayout* l = resp->add_layout();
    l->set_name(t.name);
    l->set_param_offset_bytes(t.param_offset);
    l->set_grad_offset_bytes(t.grad_offset);
    l->set_size_bytes(t.size_bytes);
    for (int64_t d : t.shape) l->add_shape(d);
    l->set_dtype(DTypeToProto(t.dtype));
  }
  resp->set_param_arena_bytes(s.layout().param_arena_bytes);
  resp->set_grad_arena_bytes(s.layout().grad_arena_bytes);
  resp->set_alignment_bytes(session::kArenaAlignment);
}

}  // namespace diond::rpc
