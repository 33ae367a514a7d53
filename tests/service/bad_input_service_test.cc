// Table-driven malformed requests against the real daemon (ARCHITECTURE.md §4 rules): each row
// sends one bad request and requires
//   - the status code and a message substring that names the field or value,
//   - every session's parameters and state unchanged (GetState with parameters, compared byte
//     for byte) and every shm segment unchanged (the trainer's arenas, FNV-1a of all bytes),
//   - no session created or lost (ListSessions ids and step indices),
//   - the daemon still serving: health check SERVING and a good RPC (a replayed Step) after.
//
// Sessions of the fixture, all with Muon "w" [8, 4] in group "m" and AdamW "b" [4] in group "a":
//   good  : both arenas in one shm segment, weights uploaded, two steps taken;
//   fresh : nothing registered or uploaded (for "before regions" and registration cases);
//   half  : PARAMETERS registered at offset 0 of a segment that has room for both arenas,
//           GRADIENTS free (for the overlap case);
//   shrunk: both arenas registered in one segment, weights uploaded, then the segment truncated
//           to 0 bytes by its trainer.
// Every message must also be bounded (it may echo client input): under 1 KiB whatever was sent.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using Code = grpc::StatusCode;

struct World {
  std::unique_ptr<Daemon> daemon;
  SessionDesc desc;
  std::unique_ptr<ShmSession> good;
  std::string fresh, half, shrunk;
  int64_t arena = 0;  // bytes of each arena (the same for params and grads here)
  std::unique_ptr<ShmSegment> half_seg, spare, shrunk_seg;
};
World* world = nullptr;

v1::Optimizer::Stub& Stub() { return world->daemon->stub(); }

v1::CreateSessionRequest Valid() { return world->desc.Request(); }

grpc::Status Create(const v1::CreateSessionRequest& req) {
  v1::CreateSessionResponse resp;
  return Stub().CreateSession(Ctx().get(), req, &resp);
}

v1::RegisterRegionRequest Region(const std::string& session, v1::RegionRole role,
                                 const std::string& name, int64_t offset, int64_t size) {
  v1::RegisterRegionRequest r;
  r.set_session_id(session);
  r.set_role(role);
  r.set_kind(v1::REGION_KIND_SYSTEM_SHM);
  r.mutable_system_shm()->set_name(name);
  r.mutable_system_shm()->set_offset_bytes(offset);
  r.mutable_system_shm()->set_size_bytes(size);
  return r;
}

grpc::Status Register(const v1::RegisterRegionRequest& r, v1::Optimizer::Stub* stub = nullptr) {
  v1::RegisterRegionResponse resp;
  return (stub ? *stub : Stub()).RegisterRegion(Ctx().get(), r, &resp);
}

grpc::Status StepWith(const std::function<void(v1::StepRequest*)>& edit) {
  v1::StepRequest req;
  req.set_session_id(world->good->id);
  req.set_step_index(3);
  edit(&req);
  v1::StepResponse resp;
  return Stub().Step(Ctx().get(), req, &resp);
}

grpc::Status SetHp(const std::string& session, const std::string& group,
                   const std::function<void(v1::Hyperparameters*)>& edit) {
  v1::SetHyperparametersRequest req;
  req.set_session_id(session);
  req.set_group(group);
  edit(req.mutable_hyperparameters());
  v1::SetHyperparametersResponse resp;
  return Stub().SetHyperparameters(Ctx().get(), req, &resp);
}

std::string Bytes(int64_t n, char fill = '\x01') {
  return std::string(static_cast<size_t>(n), fill);
}

struct BadCase {
  const char* name;
  Code code;
  const char* substring;
  std::function<grpc::Status()> call;
};

// gtest prints parameters on failure; the name says more than the bytes.
void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

// Everything a failing request must leave alone.
struct Snapshot {
  TensorMap good, half, fresh, shrunk;
  uint64_t good_seg = 0, half_seg = 0, spare = 0;
  std::vector<std::pair<std::string, int64_t>> sessions;
  bool operator==(const Snapshot& o) const {
    return good == o.good && half == o.half && fresh == o.fresh && shrunk == o.shrunk &&
           good_seg == o.good_seg && half_seg == o.half_seg && spare == o.spare &&
           sessions == o.sessions;
  }
};

Snapshot Take() {
  Snapshot s;
  EXPECT_TRUE(GetState(Stub(), world->good->id, true, &s.good).ok());
  EXPECT_TRUE(GetState(Stub(), world->half, true, &s.half).ok());
  EXPECT_TRUE(GetState(Stub(), world->fresh, false, &s.fresh).ok());
  EXPECT_TRUE(GetState(Stub(), world->shrunk, false, &s.shrunk).ok());
  s.good_seg = Fnv1a(world->good->params_seg->AllBytes());
  s.half_seg = Fnv1a(world->half_seg->AllBytes());
  s.spare = Fnv1a(world->spare->AllBytes());
  v1::ListSessionsResponse list;
  EXPECT_TRUE(Stub().ListSessions(Ctx().get(), v1::ListSessionsRequest(), &list).ok());
  for (const auto& i : list.sessions()) s.sessions.push_back({i.session_id(), i.last_step_index()});
  std::sort(s.sessions.begin(), s.sessions.end());
  return s;
}

std::vector<BadCase> Cases() {
  static constexpr int64_t kBig = int64_t{1} << 62;
  auto good = [] { return world->good->id; };
  auto arena = [] { return world->arena; };
  return {
      // ---- CreateSession ----
      {"ZeroDim", Code::INVALID_ARGUMENT, "non-positive dimension",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_shape(0, 0);
         return Create(r);
       }},
      {"NegativeDim", Code::INVALID_ARGUMENT, "[-3, 4] has a non-positive dimension",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_shape(0, -3);
         return Create(r);
       }},
      {"DtypeOutOfRange", Code::INVALID_ARGUMENT, "dtype 99",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_dtype(static_cast<v1::DType>(99));
         return Create(r);
       }},
      {"DtypeUnspecified", Code::INVALID_ARGUMENT, "dtype 0",
       [] {
         auto r = Valid();
         r.mutable_parameters(1)->set_dtype(v1::DTYPE_UNSPECIFIED);
         return Create(r);
       }},
      {"UnknownAlgorithm", Code::INVALID_ARGUMENT, "algorithm 42",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->set_algorithm(static_cast<v1::Algorithm>(42));
         return Create(r);
       }},
      {"AlgorithmUnspecified", Code::INVALID_ARGUMENT, "algorithm 0",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->set_algorithm(v1::ALGORITHM_UNSPECIFIED);
         return Create(r);
       }},
      {"NanLr", Code::INVALID_ARGUMENT, "lr = nan",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_lr(std::nan(""));
         return Create(r);
       }},
      {"NegativeLr", Code::INVALID_ARGUMENT, "lr = -0.1",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_lr(-0.1);
         return Create(r);
       }},
      {"InfiniteWeightDecay", Code::INVALID_ARGUMENT, "weight_decay = inf",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->mutable_hyperparameters()->set_weight_decay(INFINITY);
         return Create(r);
       }},
      {"MuOutOfRange", Code::INVALID_ARGUMENT, "mu = 1 is outside [0, 1)",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_mu(1.0);
         return Create(r);
       }},
      {"FractionZero", Code::INVALID_ARGUMENT, "fraction = 0",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->set_algorithm(v1::ALGORITHM_DION2);
         r.mutable_groups(0)->mutable_hyperparameters()->set_fraction(0);
         return Create(r);
       }},
      {"NumHeadsNotDividingRows", Code::INVALID_ARGUMENT, "num_heads = 3 does not divide",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->set_num_heads(3);
         return Create(r);
       }},
      {"NegativeNumHeads", Code::INVALID_ARGUMENT, "num_heads -2",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->set_num_heads(-2);
         return Create(r);
       }},
      {"SplitSizesNotSumming", Code::INVALID_ARGUMENT, "split_sizes [3,3] sum to 6",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->add_split_sizes(3);
         r.mutable_groups(0)->add_split_sizes(3);
         return Create(r);
       }},
      {"ShapeOverflowsInt64", Code::INVALID_ARGUMENT, "overflows int64",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_shape(0, kBig);
         return Create(r);
       }},
      {"ByteSizeOverflowsInt64", Code::INVALID_ARGUMENT, "too large",
       [] {
         // 2^62 elements fit int64, their 2^64 bytes do not.
         auto r = Valid();
         r.mutable_parameters(1)->set_shape(0, kBig);
         return Create(r);
       }},
      {"HugeStateDoesNotFitInMemory", Code::RESOURCE_EXHAUSTED, "bytes of memory",
       [] {
         // 2^51 elements: representable (8 PiB of fp32), but no host can hold the momentum.
         auto r = Valid();
         r.mutable_parameters(0)->set_shape(0, int64_t{1} << 31);
         r.mutable_parameters(0)->set_shape(1, int64_t{1} << 20);
         return Create(r);
       }},
      {"TooManyDims", Code::INVALID_ARGUMENT, "at most 8",
       [] {
         auto r = Valid();
         r.mutable_parameters(1)->clear_shape();
         for (int i = 0; i < 9; ++i) r.mutable_parameters(1)->add_shape(1);
         return Create(r);
       }},
      {"DuplicateParameterNames", Code::INVALID_ARGUMENT, "duplicate parameter name 'w'",
       [] {
         auto r = Valid();
         r.mutable_parameters(1)->set_name("w");
         return Create(r);
       }},
      {"EmptyParameterList", Code::INVALID_ARGUMENT, "at least one parameter",
       [] {
         auto r = Valid();
         r.clear_parameters();
         return Create(r);
       }},
      {"ParameterNamesUnknownGroup", Code::INVALID_ARGUMENT, "unknown group 'nope'",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_group("nope");
         return Create(r);
       }},
      {"DuplicateGroupNames", Code::INVALID_ARGUMENT, "duplicate group name 'm'",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->set_name("m");
         return Create(r);
       }},
      {"ParameterNameWithStateSuffix", Code::INVALID_ARGUMENT, "may not contain '/state.'",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_name("x/state.momentum");
         return Create(r);
       }},
      {"OversampleOutOfRange", Code::INVALID_ARGUMENT, "oversample",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_oversample(0.0);
         return Create(r);
       }},
      {"UnknownQrMethod", Code::INVALID_ARGUMENT, "qr_method 9 is unknown",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_qr_method(
             static_cast<v1::QrMethod>(9));
         return Create(r);
       }},
      {"UnknownNonFinitePolicy", Code::INVALID_ARGUMENT, "non_finite_policy 7",
       [] {
         auto r = Valid();
         r.set_non_finite_policy(static_cast<v1::NonFinitePolicy>(7));
         return Create(r);
       }},
      {"GradientSyncNeedsAWorld", Code::UNIMPLEMENTED, "REPLICATED",
       [] {
         auto r = Valid();
         r.set_gradient_sync(v1::GRADIENT_SYNC_AVERAGE);
         return Create(r);
       }},
      // ---- RegisterRegion ----
      {"RegionLargerThanSegment", Code::OUT_OF_RANGE, "exceeds the segment",
       [] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS, world->spare->name(), 0,
                                world->spare->size() + 256));
       }},
      {"RegionOffsetPastSegment", Code::OUT_OF_RANGE, "exceeds the segment",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_GRADIENTS, world->spare->name(),
                                world->spare->size(), arena()));
       }},
      {"RegionSizeOverflowsInt64", Code::INVALID_ARGUMENT, "overflows int64",
       [] {
         return Register(Region(world->fresh, v1::REGION_ROLE_GRADIENTS, world->spare->name(), 256,
                                std::numeric_limits<int64_t>::max()));
       }},
      {"RegionsOverlapInOneSegment", Code::INVALID_ARGUMENT, "overlaps the PARAMETERS region",
       [arena] {
         return Register(
             Region(world->half, v1::REGION_ROLE_GRADIENTS, world->half_seg->name(), 0, arena()));
       }},
      {"MissingShmName", Code::INVALID_ARGUMENT, "shm name ''",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS, "", 0, arena()));
       }},
      {"ShmNameWithSlash", Code::INVALID_ARGUMENT, "no paths",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS,
                                "dev/" + world->spare->name(), 0, arena()));
       }},
      {"ShmNameDotDot", Code::INVALID_ARGUMENT, "no paths",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS, "..", 0, arena()));
       }},
      {"ShmNameTraversal", Code::INVALID_ARGUMENT, "no paths",
       [arena] {
         return Register(
             Region(world->fresh, v1::REGION_ROLE_PARAMETERS, "../../etc/passwd", 0, arena()));
       }},
      {"NonexistentSegment", Code::NOT_FOUND, "does not exist",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS,
                                "diond-svc-test-no-such-segment", 0, arena()));
       }},
      {"RegionOffsetNotAligned", Code::INVALID_ARGUMENT, "multiple of 256",
       [arena] {
         return Register(
             Region(world->fresh, v1::REGION_ROLE_PARAMETERS, world->spare->name(), 100, arena()));
       }},
      {"RegionNegativeOffset", Code::INVALID_ARGUMENT, "multiple of 256",
       [arena] {
         return Register(
             Region(world->fresh, v1::REGION_ROLE_PARAMETERS, world->spare->name(), -256, arena()));
       }},
      {"RoleRegisteredTwice", Code::FAILED_PRECONDITION, "already has region",
       [arena] {
         return Register(
             Region(world->good->id, v1::REGION_ROLE_PARAMETERS, world->spare->name(), 0, arena()));
       }},
      {"RegionSmallerThanArena", Code::INVALID_ARGUMENT, "smaller than the GRADIENTS arena",
       [arena] {
         return Register(
             Region(world->fresh, v1::REGION_ROLE_GRADIENTS, world->spare->name(), 0, arena() - 4));
       }},
      {"RoleUnspecified", Code::INVALID_ARGUMENT, "role 0",
       [arena] {
         return Register(
             Region(world->fresh, v1::REGION_ROLE_UNSPECIFIED, world->spare->name(), 0, arena()));
       }},
      {"RegionBodyMissing", Code::INVALID_ARGUMENT, "needs system_shm",
       [] {
         auto r = Region(world->fresh, v1::REGION_ROLE_PARAMETERS, "x", 0, 0);
         r.clear_system_shm();
         return Register(r);
       }},
      {"RegionKindCudaWithoutItsBody", Code::INVALID_ARGUMENT,
       "REGION_KIND_CUDA_IPC needs cuda_ipc",
       [arena] {
         auto r =
             Region(world->fresh, v1::REGION_ROLE_PARAMETERS, world->spare->name(), 0, arena());
         r.set_kind(v1::REGION_KIND_CUDA_IPC);
         return Register(r);
       }},
      {"RegionOverTcpWithoutFlag", Code::PERMISSION_DENIED, "--allow_shm_from_tcp",
       [arena] {
         auto tcp = world->daemon->NewTcpStub();
         return Register(
             Region(world->fresh, v1::REGION_ROLE_PARAMETERS, world->spare->name(), 0, arena()),
             tcp.get());
       }},
      {"SaveCheckpointAbsolutePathOverTcp", Code::PERMISSION_DENIED, "relative to --state_dir",
       [good] {
         auto tcp = world->daemon->NewTcpStub();
         v1::SaveCheckpointRequest r;
         r.set_session_id(good());
         r.set_directory("/tmp/elsewhere");
         v1::SaveCheckpointResponse resp;
         return tcp->SaveCheckpoint(Ctx().get(), r, &resp);
       }},
      {"LoadCheckpointEscapingPathOverTcp", Code::PERMISSION_DENIED, "relative to --state_dir",
       [] {
         auto tcp = world->daemon->NewTcpStub();
         v1::LoadCheckpointRequest r;
         r.set_path("../../etc");
         v1::LoadCheckpointResponse resp;
         return tcp->LoadCheckpoint(Ctx().get(), r, &resp);
       }},
      {"RegisterUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [arena] {
         return Register(
             Region("s-nope", v1::REGION_ROLE_PARAMETERS, world->spare->name(), 0, arena()));
       }},
      {"UnregisterUnknownRegion", Code::NOT_FOUND, "no region 'params-99'",
       [good] {
         v1::UnregisterRegionRequest r;
         r.set_session_id(good());
         r.set_region_id("params-99");
         v1::UnregisterRegionResponse resp;
         return Stub().UnregisterRegion(Ctx().get(), r, &resp);
       }},
      // ---- Step ----
      {"StepUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] { return StepWith([](v1::StepRequest* r) { r->set_session_id("s-nope"); }); }},
      {"StepBeforeRegions", Code::FAILED_PRECONDITION, "no parameters",
       [] { return DoStep(Stub(), world->fresh, 1); }},
      {"StepSkippedIndex", Code::FAILED_PRECONDITION, "expected 3",
       [] { return StepWith([](v1::StepRequest* r) { r->set_step_index(4); }); }},
      {"StepOldIndex", Code::FAILED_PRECONDITION, "expected 3",
       [] { return StepWith([](v1::StepRequest* r) { r->set_step_index(1); }); }},
      {"LrOverrideUnknownGroup", Code::INVALID_ARGUMENT, "unknown group 'zzz'",
       [] {
         return StepWith([](v1::StepRequest* r) { (*r->mutable_lr_override())["zzz"] = 0.1; });
       }},
      {"NegativeLrOverride", Code::INVALID_ARGUMENT, "lr_override['m'] = -1",
       [] { return StepWith([](v1::StepRequest* r) { (*r->mutable_lr_override())["m"] = -1; }); }},
      {"NanLrOverride", Code::INVALID_ARGUMENT, "lr_override['a'] = nan",
       [] {
         return StepWith(
             [](v1::StepRequest* r) { (*r->mutable_lr_override())["a"] = std::nan(""); });
       }},
      {"GroupStepUnknownGroup", Code::INVALID_ARGUMENT, "group_step names unknown group 'zzz'",
       [] { return StepWith([](v1::StepRequest* r) { (*r->mutable_group_step())["zzz"] = 3; }); }},
      {"GroupStepZero", Code::INVALID_ARGUMENT, "group_step['m'] = 0 must be >= 1",
       [] { return StepWith([](v1::StepRequest* r) { (*r->mutable_group_step())["m"] = 0; }); }},
      {"NanGradientScale", Code::INVALID_ARGUMENT, "gradient_scale nan",
       [] { return StepWith([](v1::StepRequest* r) { r->set_gradient_scale(std::nan("")); }); }},
      {"NegativeGradientScale", Code::INVALID_ARGUMENT, "gradient_scale -2",
       [] { return StepWith([](v1::StepRequest* r) { r->set_gradient_scale(-2); }); }},
      // ---- PushGradients (into the good session's shm gradient arena) ----
      {"PushChunkPastEnd", Code::INVALID_ARGUMENT, "runs past its end",
       [good] {
         return PushGradients(Stub(), good(), {{"w", 0, Bytes(112)}, {"w", 112, Bytes(32)}});
       }},
      {"PushTruncatedTensor", Code::INVALID_ARGUMENT, "incomplete",
       [good] {
         return PushGradients(Stub(), good(), {{"b", 0, Bytes(16)}, {"w", 0, Bytes(64)}});
       }},
      {"PushChunkOver4MiB", Code::INVALID_ARGUMENT, "the limit is 4194304",
       [good] {
         return PushGradients(Stub(), good(), {{"w", 0, Bytes((4 << 20) + 4)}});
       }},
      {"PushUnknownTensor", Code::INVALID_ARGUMENT, "unknown tensor 'zz'",
       [good] {
         return PushGradients(Stub(), good(), {{"zz", 0, Bytes(16)}});
       }},
      {"PushStateName", Code::INVALID_ARGUMENT, "not state 'w/state.momentum'",
       [good] {
         return PushGradients(Stub(), good(), {{"w/state.momentum", 0, Bytes(128)}});
       }},
      {"PushMisalignedChunk", Code::INVALID_ARGUMENT, "not aligned",
       [good] {
         return PushGradients(Stub(), good(), {{"w", 0, Bytes(3)}, {"w", 3, Bytes(125)}});
       }},
      {"PushWithoutSessionId", Code::INVALID_ARGUMENT, "must carry session_id",
       [] {
         return PushGradients(Stub(), "", {{"w", 0, Bytes(128)}});
       }},
      {"PushUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         return PushGradients(Stub(), "s-nope", {{"w", 0, Bytes(128)}});
       }},
      // ---- SetState ----
      {"SetStateChunkPastEnd", Code::INVALID_ARGUMENT, "runs past its end",
       [good] {
         return SetState(Stub(), good(), {{"b", 8, Bytes(16)}});
       }},
      {"SetStateTruncatedTensor", Code::INVALID_ARGUMENT, "incomplete",
       [good] {
         return SetState(Stub(), good(), {{"w/state.momentum", 0, Bytes(128)}, {"b", 0, Bytes(8)}});
       }},
      {"SetStateWrongElementCount", Code::INVALID_ARGUMENT, "124 of 128 bytes",
       [good] {
         return SetState(Stub(), good(), {{"w", 0, Bytes(124)}});
       }},
      {"SetStateChunkWrittenTwice", Code::INVALID_ARGUMENT, "written twice",
       [good] {
         return SetState(Stub(), good(), {{"b", 0, Bytes(16)}, {"b", 0, Bytes(16)}});
       }},
      {"SetStateUnknownTensor", Code::INVALID_ARGUMENT, "unknown tensor 'nope'",
       [good] {
         return SetState(Stub(), good(), {{"b", 0, Bytes(16)}, {"nope", 0, Bytes(16)}});
       }},
      {"SetStateUnknownStateName", Code::INVALID_ARGUMENT, "unknown state 'w/state.variance'",
       [good] {
         return SetState(Stub(), good(), {{"w/state.variance", 0, Bytes(128)}});
       }},
      {"SetStateOfUnknownParameter", Code::INVALID_ARGUMENT, "unknown parameter 'zz'",
       [good] {
         return SetState(Stub(), good(), {{"zz/state.momentum", 0, Bytes(128)}});
       }},
      {"SetStateChunkOver4MiB", Code::INVALID_ARGUMENT, "the limit is 4194304",
       [good] {
         return SetState(Stub(), good(), {{"w", 0, Bytes((4 << 20) + 4)}});
       }},
      {"SetStateUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         return SetState(Stub(), "s-nope", {{"w", 0, Bytes(128)}});
       }},
      // ---- reads ----
      {"PullUnknownParameter", Code::INVALID_ARGUMENT, "unknown parameter 'zz'",
       [good] {
         TensorMap m;
         return PullParameters(Stub(), good(), &m, 0, {"zz"});
       }},
      // The service's own echo once repeated control characters raw (a two-line message).
      {"PullUnknownParameterWithANewline", Code::INVALID_ARGUMENT, "unknown parameter 'z?z'",
       [good] {
         TensorMap m;
         return PullParameters(Stub(), good(), &m, 0, {"z\nz"});
       }},
      {"PullNegativeChunkBytes", Code::INVALID_ARGUMENT, "chunk_bytes -8",
       [good] {
         TensorMap m;
         return PullParameters(Stub(), good(), &m, -8);
       }},
      {"PullUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         TensorMap m;
         return PullParameters(Stub(), "s-nope", &m);
       }},
      {"GetStateUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         TensorMap m;
         return GetState(Stub(), "s-nope", true, &m);
       }},
      // ---- SetHyperparameters ----
      {"SetHyperparametersUnsupportedField", Code::INVALID_ARGUMENT, "lr and weight_decay only",
       [good] {
         return SetHp(good(), "m", [](v1::Hyperparameters* h) {
           h->set_lr(0.1);
           h->set_mu(0.5);
         });
       }},
      {"SetHyperparametersUnknownGroup", Code::INVALID_ARGUMENT, "unknown group 'zzz'",
       [good] { return SetHp(good(), "zzz", [](v1::Hyperparameters* h) { h->set_lr(0.1); }); }},
      {"SetHyperparametersNegativeLr", Code::INVALID_ARGUMENT, "lr = -0.5",
       [good] { return SetHp(good(), "m", [](v1::Hyperparameters* h) { h->set_lr(-0.5); }); }},
      {"SetHyperparametersNanWeightDecay", Code::INVALID_ARGUMENT, "weight_decay = nan",
       [good] {
         return SetHp(good(), "a", [](v1::Hyperparameters* h) {
           h->set_lr(0.1);
           h->set_weight_decay(std::nan(""));
         });
       }},
      {"SetHyperparametersUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] { return SetHp("s-nope", "m", [](v1::Hyperparameters* h) { h->set_lr(0.1); }); }},
      // ---- checkpoints and lifecycle ----
      {"LoadCheckpointNonexistentPath", Code::NOT_FOUND,
       "no checkpoint directory at /nonexistent/ckpt",
       [] {
         v1::LoadCheckpointRequest r;
         r.set_path("/nonexistent/ckpt");
         v1::LoadCheckpointResponse resp;
         return Stub().LoadCheckpoint(Ctx().get(), r, &resp);
       }},
      {"LoadCheckpointEmptyPath", Code::INVALID_ARGUMENT, "needs a path",
       [] {
         v1::LoadCheckpointResponse resp;
         return Stub().LoadCheckpoint(Ctx().get(), v1::LoadCheckpointRequest(), &resp);
       }},
      {"SaveCheckpointWithoutStateDir", Code::FAILED_PRECONDITION, "--state_dir",
       [good] {
         v1::SaveCheckpointRequest r;
         r.set_session_id(good());
         v1::SaveCheckpointResponse resp;
         return Stub().SaveCheckpoint(Ctx().get(), r, &resp);
       }},
      {"CloseUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] { return CloseSession(Stub(), "s-nope"); }},
      // ---- a truncated segment ----
      {"StepOnTruncatedSegment", Code::FAILED_PRECONDITION, "shrank: its segment now has 0 bytes",
       [] { return DoStep(Stub(), world->shrunk, 1); }},
      {"PullFromTruncatedSegment", Code::FAILED_PRECONDITION, "shrank",
       [] {
         TensorMap m;
         return PullParameters(Stub(), world->shrunk, &m);
       }},
      {"PushIntoTruncatedSegment", Code::FAILED_PRECONDITION, "shrank",
       [] {
         return PushGradients(Stub(), world->shrunk, {{"w", 0, Bytes(128)}, {"b", 0, Bytes(16)}});
       }},
      {"SetStateIntoTruncatedSegment", Code::FAILED_PRECONDITION, "shrank",
       [] {
         return SetState(Stub(), world->shrunk,
                         {{"b", 0, Bytes(16)}, {"b/state.momentum", 0, Bytes(16)}});
       }},
      // ---- streams validated as they arrive, bounded ----
      {"PushManyChunksToUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         return PushGradients(Stub(), "s-nope",
                              std::vector<Chunk>(64, Chunk{"w", 0, Bytes(1 << 20)}));
       }},
      {"SetStateManyChunksToUnknownSession", Code::NOT_FOUND, "unknown session 's-nope'",
       [] {
         return SetState(Stub(), "s-nope", std::vector<Chunk>(64, Chunk{"w", 0, Bytes(1 << 20)}));
       }},
      {"PushMoreBytesThanTheSessionHas", Code::INVALID_ARGUMENT, "more than the 144 bytes",
       [good] {
         return PushGradients(Stub(), good(), std::vector<Chunk>(64, Chunk{"w", 0, Bytes(128)}));
       }},
      {"PushUnknownTensorInALaterChunk", Code::INVALID_ARGUMENT, "unknown tensor 'zz'",
       [good] {
         std::vector<Chunk> c{{"w", 0, Bytes(128)}, {"zz", 0, Bytes(16)}};
         for (int i = 0; i < 32; ++i) c.push_back({"b", 0, Bytes(1 << 20)});
         return PushGradients(Stub(), good(), c);
       }},
      {"SetStateChunkNamesAnotherSession", Code::INVALID_ARGUMENT, "names session 's-other'",
       [good] {
         auto ctx = Ctx();
         v1::SetStateResponse resp;
         auto w = Stub().SetState(ctx.get(), &resp);
         v1::TensorChunk c;
         c.set_session_id(good());
         c.set_name("b");
         c.set_data(Bytes(16));
         w->Write(c);
         c.set_session_id("s-other");
         w->Write(c);
         w->WritesDone();
         return w->Finish();
       }},
      // ---- bounded messages ----
      {"PushHugeTensorName", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [good] {
         return PushGradients(Stub(), good(), {{std::string(1 << 20, 'n'), 0, Bytes(16)}});
       }},
      {"SetStateHugeTensorName", Code::INVALID_ARGUMENT, "(1048591 bytes)",
       [good] {
         return SetState(Stub(), good(),
                         {{std::string(1 << 20, 'n') + "/state.momentum", 0, Bytes(16)}});
       }},
      {"HugeParameterName", Code::INVALID_ARGUMENT, "must be 1..512 bytes",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_name(std::string(1 << 20, 'p'));
         return Create(r);
       }},
      {"HugeGroupName", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->set_name(std::string(1 << 20, 'g'));
         r.mutable_parameters(0)->set_group(std::string(1 << 20, 'g'));
         return Create(r);
       }},
      {"HugeUnknownGroupReference", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [] {
         auto r = Valid();
         r.mutable_parameters(0)->set_group(std::string(1 << 20, 'q'));
         return Create(r);
       }},
      {"MillionSplitSizes", Code::INVALID_ARGUMENT, "(1000000 entries)",
       [] {
         auto r = Valid();
         for (int i = 0; i < 1000000; ++i) r.mutable_groups(0)->add_split_sizes(1);
         return Create(r);
       }},
      {"HugeShmName", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS, std::string(1 << 20, 's'),
                                0, arena()));
       }},
      {"HugeLrOverrideGroup", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [] {
         return StepWith([](v1::StepRequest* r) {
           (*r->mutable_lr_override())[std::string(1 << 20, 'z')] = 0.1;
         });
       }},
      {"HugeSessionId", Code::NOT_FOUND, "(1048576 bytes)",
       [] {
         return StepWith([](v1::StepRequest* r) { r->set_session_id(std::string(1 << 20, 'i')); });
       }},
      {"HugeSetHyperparametersGroup", Code::INVALID_ARGUMENT, "(1048576 bytes)",
       [good] {
         return SetHp(good(), std::string(1 << 20, 'h'),
                      [](v1::Hyperparameters* h) { h->set_lr(0.1); });
       }},
      {"HugeRegionId", Code::NOT_FOUND, "(1048576 bytes)",
       [good] {
         v1::UnregisterRegionRequest r;
         r.set_session_id(good());
         r.set_region_id(std::string(1 << 20, 'r'));
         v1::UnregisterRegionResponse resp;
         return Stub().UnregisterRegion(Ctx().get(), r, &resp);
       }},
      // ---- every option validated at CreateSession ----
      {"MuonLrOverflowsFp32", Code::INVALID_ARGUMENT, "lr = 1e+308 is outside [0, 10000]",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_lr(1e308);
         return Create(r);
       }},
      {"AdamWLrOverflowsFp32", Code::INVALID_ARGUMENT, "lr = 1e+308 is outside [0, 10000]",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->mutable_hyperparameters()->set_lr(1e308);
         return Create(r);
       }},
      {"LionLrOverflowsFp32", Code::INVALID_ARGUMENT, "lr = 1e+308 is outside [0, 10000]",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->set_algorithm(v1::ALGORITHM_LION);
         r.mutable_groups(1)->mutable_hyperparameters()->set_lr(1e308);
         return Create(r);
       }},
      {"HugeWeightDecay", Code::INVALID_ARGUMENT, "weight_decay = 1e+300 is outside",
       [] {
         auto r = Valid();
         r.mutable_groups(0)->mutable_hyperparameters()->set_weight_decay(1e300);
         return Create(r);
       }},
      {"HugeEpsilon", Code::INVALID_ARGUMENT, "epsilon = 1e+300 is outside",
       [] {
         auto r = Valid();
         r.mutable_groups(1)->mutable_hyperparameters()->set_epsilon(1e300);
         return Create(r);
       }},
      {"SetHyperparametersLrOverflowsFp32", Code::INVALID_ARGUMENT, "lr = 1e+308 is outside",
       [good] { return SetHp(good(), "m", [](v1::Hyperparameters* h) { h->set_lr(1e308); }); }},
      {"LrOverrideOverflowsFp32", Code::INVALID_ARGUMENT, "lr_override['m'] = 1e+308 is outside",
       [] {
         return StepWith([](v1::StepRequest* r) { (*r->mutable_lr_override())["m"] = 1e308; });
       }},
      // ---- a segment belongs to one session ----
      {"RegisterAnotherSessionsSegment", Code::FAILED_PRECONDITION, "registered by another session",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_PARAMETERS,
                                world->good->params_seg->name(), 0, arena()));
       }},
      {"RegisterAnotherSessionsSegmentElsewhere", Code::FAILED_PRECONDITION,
       "registered by another session",
       [arena] {
         return Register(Region(world->fresh, v1::REGION_ROLE_GRADIENTS, world->half_seg->name(),
                                arena(), arena()));
       }},
  };
}

class BadInput : public ::testing::TestWithParam<BadCase> {
 protected:
  static void SetUpTestSuite() {
    world = new World;
    world->daemon = Daemon::Start({}, /*tcp=*/true);
    if (world->daemon == nullptr) return;
    SessionDesc& d = world->desc;
    d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
    d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
    d.params.push_back({"w", {8, 4}, "m"});
    d.params.push_back({"b", {4}, "a"});
    world->good = CreateShmSession(Stub(), d.Request());
    ASSERT_NE(world->good, nullptr);
    world->arena = world->good->layout.param_arena_bytes();
    ASSERT_EQ(world->arena, world->good->layout.grad_arena_bytes());
    ASSERT_TRUE(SetState(Stub(), world->good->id,
                         {{"w", 0, FloatBytes(SyntheticValues(1, 0, 0, 32))},
                          {"b", 0, FloatBytes(SyntheticValues(1, 0, 1, 4))}})
                    .ok());
    for (int64_t t = 1; t <= 2; ++t) {
      world->good->WriteGrad(0, SyntheticValues(2, t, 0, 32));
      world->good->WriteGrad(1, SyntheticValues(2, t, 1, 4));
      ASSERT_TRUE(DoStep(Stub(), world->good->id, t).ok());
    }
    v1::CreateSessionResponse resp;
    ASSERT_TRUE(Stub().CreateSession(Ctx().get(), d.Request(), &resp).ok());
    world->fresh = resp.session_id();
    ASSERT_TRUE(Stub().CreateSession(Ctx().get(), d.Request(), &resp).ok());
    world->half = resp.session_id();
    world->half_seg = ShmSegment::Create(2 * world->arena);
    world->spare = ShmSegment::Create(64 << 10);
    ASSERT_NE(world->half_seg, nullptr);
    ASSERT_NE(world->spare, nullptr);
    // Recognizable non-zero bytes, so that any write into them shows.
    world->half_seg->Write(0, Bytes(world->half_seg->size(), '\x5a'));
    world->spare->Write(0, Bytes(world->spare->size(), '\x3c'));
    ASSERT_TRUE(Register(Region(world->half, v1::REGION_ROLE_PARAMETERS, world->half_seg->name(), 0,
                                world->arena))
                    .ok());
    // The shrunk session: registered, weights uploaded, then its trainer truncates the segment.
    ASSERT_TRUE(Stub().CreateSession(Ctx().get(), d.Request(), &resp).ok());
    world->shrunk = resp.session_id();
    world->shrunk_seg = ShmSegment::Create(2 * world->arena);
    ASSERT_NE(world->shrunk_seg, nullptr);
    ASSERT_TRUE(Register(Region(world->shrunk, v1::REGION_ROLE_PARAMETERS,
                                world->shrunk_seg->name(), 0, world->arena))
                    .ok());
    ASSERT_TRUE(Register(Region(world->shrunk, v1::REGION_ROLE_GRADIENTS, world->shrunk_seg->name(),
                                world->arena, world->arena))
                    .ok());
    ASSERT_TRUE(SetState(Stub(), world->shrunk,
                         {{"w", 0, FloatBytes(SyntheticValues(3, 0, 0, 32))},
                          {"b", 0, FloatBytes(SyntheticValues(3, 0, 1, 4))}})
                    .ok());
    ASSERT_TRUE(world->shrunk_seg->Truncate(0));
  }
  static void TearDownTestSuite() {
    delete world;
    world = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(world, nullptr);
    ASSERT_NE(world->daemon, nullptr);
    ASSERT_NE(world->good, nullptr);
    ASSERT_NE(world->spare, nullptr);
  }
};

TEST_P(BadInput, IsRefusedWithAUsefulMessageAndChangesNothing) {
  const BadCase& c = GetParam();
  const Snapshot before = Take();
  grpc::Status st = c.call();
  EXPECT_EQ(st.error_code(), c.code) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), c.substring))
      << "message '" << st.error_message().substr(0, 2000) << "' lacks '" << c.substring << "'";
  EXPECT_LT(st.error_message().size(), 1024u) << "unbounded message";
  const Snapshot after = Take();
  EXPECT_TRUE(after == before) << "state, parameters, shm arenas or the session list changed";
  // Still serving: health, and a good RPC (a replay of the last step, which mutates nothing).
  EXPECT_TRUE(world->daemon->Serving());
  v1::StepResponse resp;
  grpc::Status replay = DoStep(Stub(), world->good->id, 2, &resp);
  EXPECT_TRUE(replay.ok()) << replay.error_message();
  EXPECT_TRUE(resp.replayed());
}

TEST(BadInputTable, HasAtLeastThirtyDistinctCases) {
  std::set<std::string> names;
  for (const BadCase& c : Cases()) names.insert(c.name);
  EXPECT_GE(names.size(), 30u);
  EXPECT_EQ(names.size(), Cases().size()) << "duplicate case names";
}

// Peak resident memory of a process (VmHWM), in bytes.
int64_t PeakRss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmHWM:")) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// Sends `count` chunks of `bytes` bytes of tensor `name` (the same buffer each time), the first
// naming `session`, until the daemon ends the stream.
grpc::Status Flood(v1::Optimizer::Stub& stub, bool set_state, const std::string& session,
                   const std::string& name, int count, int64_t bytes) {
  auto ctx = Ctx();
  v1::PushGradientsResponse push;
  v1::SetStateResponse set;
  std::unique_ptr<grpc::ClientWriter<v1::TensorChunk>> w =
      set_state ? stub.SetState(ctx.get(), &set) : stub.PushGradients(ctx.get(), &push);
  v1::TensorChunk c;
  c.set_session_id(session);
  c.set_name(name);
  c.set_data(std::string(static_cast<size_t>(bytes), '\x01'));
  for (int i = 0; i < count; ++i) {
    c.set_offset_bytes(i * bytes);
    if (!w->Write(c)) break;
    c.clear_session_id();
  }
  w->WritesDone();
  return w->Finish();
}

// A stream is checked chunk by chunk before it is buffered: buffered whole, 200 chunks of 4 MiB to
// an unknown session take 870 MB of daemon RSS before the session is looked up.
TEST(StreamBounds, FloodsAreRefusedBeforeTheyAreBuffered) {
  auto daemon = Daemon::Start({"--max_stream_bytes=8388608"});
  ASSERT_NE(daemon, nullptr);
  SessionDesc d;
  d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"e", {4 << 20}, "a"});  // 16 MiB of gradients
  v1::CreateSessionResponse created;
  ASSERT_TRUE(daemon->stub().CreateSession(Ctx().get(), d.Request(), &created).ok());
  const int64_t chunk = (4 << 20) - 1024;  // under the 4 MiB message limit with its header
  const int64_t before = PeakRss(daemon->pid());
  for (bool set_state : {false, true}) {
    grpc::Status st = Flood(daemon->stub(), set_state, "s-nope", "e", 200, chunk);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    // A known session and tensor: refused at --max_stream_bytes (8 MiB), within 3 chunks.
    st = Flood(daemon->stub(), set_state, created.session_id(), "e", 200, chunk / 4 * 4);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "--max_stream_bytes=8388608"));
  }
  const int64_t after = PeakRss(daemon->pid());
  std::printf(
      "daemon peak RSS before the floods %.1f MiB, after %.1f MiB (4 floods of 200 x 4 "
      "MiB)\n",
      before / 1048576.0, after / 1048576.0);
  RecordProperty("peak_rss_before_bytes", std::to_string(before));
  RecordProperty("peak_rss_after_bytes", std::to_string(after));
  // Each refused stream buffered at most two chunks (8 MiB); gRPC's own buffers come on top
  // (measured: +30 MiB; +87 MiB under ASan, whose quarantine holds freed memory). Buffering a
  // whole flood would add 800 MiB.
  EXPECT_LT(after - before, int64_t{160} << 20);
  EXPECT_TRUE(daemon->Serving());
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<BadCase>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace diond::service_testing
