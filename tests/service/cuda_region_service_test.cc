// CUDA regions through the daemon's RPCs (docs/DATA_PLANE.md "CUDA regions"), on the host-memory
// TEST backend: no GPU runs any of this. The TEST backend's handoff emulation (CUDA IPC handles,
// VMM fds) works within one process only, so the daemon (server::Daemon, the one diond runs) runs
// in this test's process, serving its Unix socket and fd channel; the test plays the trainer over
// gRPC and the fd channel as a trainer process would, with its "GPU memory" made by the TEST
// backend in STRICT mode: that memory is PROT_NONE outside the backend's own entries, so any host
// dereference by the daemon faults at once (the test process dies).
//
// Checked: the region kinds advertised; RegisterRegion CUDA_IPC / CUDA_VMM_FD (with its fd over
// the real fd channel) and every refusal (foreign GPU, another device, bad handle, out of range,
// smaller than the arena, role taken, bad token) with nothing left open; sessions stepped over
// CUDA regions equal, bit for bit over several steps, the same sessions stepped over shm on the
// same TEST device, for AdamW, Muon, Dion and Lion, synchronous and asynchronous; such a step
// copies nothing between host and device but the per-group norms; a failed step (non-finite
// gradients, a bad step index) changes no weight byte and no state; the mappings are released on
// UnregisterRegion, CloseSession and daemon stop.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "diond/memfd_arena.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"
#include "server/exe/daemon.h"
#include "server/memory/cuda_region.h"
#include "server/rpc/listen.h"
#include "tests/service/cuda_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

constexpr int kSteps = 3;

SessionDesc Desc(AlgorithmKind algorithm) { return TwoMatricesAndABias(algorithm); }

std::vector<Chunk> InitialParams(const SessionDesc& d) { return SyntheticWeights(d, 1); }

bool HasKind(const v1::CreateSessionResponse& r, v1::RegionKind kind) {
  for (int k : r.region_kinds()) {
    if (k == kind) return true;
  }
  return false;
}

TEST_F(CudaRegions, ADeviceDaemonAdvertisesTheCudaKinds) {
  v1::CreateSessionResponse r;
  ASSERT_TRUE(Create(Desc(AlgorithmKind::kAdamW).Request(), &r).ok());
  EXPECT_TRUE(HasKind(r, v1::REGION_KIND_SYSTEM_SHM));
  EXPECT_TRUE(HasKind(r, v1::REGION_KIND_MEMFD));
  EXPECT_TRUE(HasKind(r, v1::REGION_KIND_CUDA_IPC));
  EXPECT_TRUE(HasKind(r, v1::REGION_KIND_CUDA_VMM_FD));
}

struct Case {
  AlgorithmKind algorithm;
  bool vmm;
  bool async;
};

class CudaEqualsShm : public CudaRegions, public ::testing::WithParamInterface<Case> {};

TEST_P(CudaEqualsShm, BitForBitOverSeveralStepsWithNoHostCopies) {
  const Case k = GetParam();
  const SessionDesc d = Desc(k.algorithm);
  auto shm = CreateShmSession(stub(), d.Request());
  auto gpu = CreateCudaSession(d.Request(), k.vmm);
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(gpu, nullptr);
  // The initial weights go into the CUDA region through SetState (the daemon's explicit copies).
  ASSERT_TRUE(SetState(stub(), shm->id, InitialParams(d)).ok());
  ASSERT_TRUE(SetState(stub(), gpu->id, InitialParams(d)).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    ASSERT_EQ(gpu->ParamBytes(i), shm->ParamBytes(i)) << d.params[i].name;
  }
  const int64_t tensors = static_cast<int64_t>(d.params.size());
  // Each group's update norms come down queued with the weights (one copy a group).
  const int64_t groups = static_cast<int64_t>(d.groups.size());
  int64_t numel = 0;
  for (size_t i = 0; i < d.params.size(); ++i) numel += d.Numel(i);
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::vector<float> grad = SyntheticValues(7, t, i, d.Numel(i));
      shm->WriteGrad(i, grad);
      gpu->WriteGrad(i, grad);
    }
    // Step 2 scales the gradients: widened and scaled from the region into the staging.
    const double scale = t == 2 ? 0.5 : 1.0;
    v1::StepResponse rs, rg;
    const kt::HostTestDeviceCounters start = kt::GetHostTestDeviceCounters();
    grpc::Status ss = Step(shm->id, t, scale, &rs);
    ASSERT_TRUE(ss.ok()) << ss.error_message();
    const kt::HostTestDeviceCounters before = kt::GetHostTestDeviceCounters();
    grpc::Status sg = Step(gpu->id, t, scale, &rg, k.async);
    if (k.async) {
      ASSERT_TRUE(sg.ok()) << sg.error_message();
      EXPECT_TRUE(rg.queued());
      rg.Clear();
      sg = Step(gpu->id, t, 0, &rg, false, /*wait=*/true);
    }
    ASSERT_TRUE(sg.ok()) << sg.error_message();
    const kt::HostTestDeviceCounters after = kt::GetHostTestDeviceCounters();
    EXPECT_FALSE(rg.skipped());
    EXPECT_FALSE(rg.queued());
    // Device to device: the step over shm copies every gradient and weight host -> device and
    // every weight back; the step over CUDA regions none of them. What remains is the same on
    // both (the rules' own sync points, e.g. each group's Σ(Δx)² read back).
    const int64_t shm_to_device = before.copies_to_device - start.copies_to_device;
    const int64_t shm_to_host = before.copies_to_host - start.copies_to_host;
    EXPECT_GE(shm_to_device, 2 * tensors);
    EXPECT_EQ(after.copies_to_device - before.copies_to_device, shm_to_device - 2 * tensors)
        << "step " << t;
    EXPECT_EQ(after.bytes_to_device - before.bytes_to_device,
              before.bytes_to_device - start.bytes_to_device - int64_t{2} * 4 * numel)
        << "step " << t;
    EXPECT_EQ(after.copies_to_host - before.copies_to_host, shm_to_host - tensors) << "step " << t;
    EXPECT_EQ(after.bytes_to_host - before.bytes_to_host,
              before.bytes_to_host - start.bytes_to_host - 4 * numel)
        << "step " << t;
    // asynccopy: the shm step's copies are all queued; both steps wait as often (the flag's
    // read-back, the final wait, the rules' own), and the CUDA step queues no copy of
    // gradients or weights (only the groups' update norms and the non-finite flag come down).
    // From step 2 each step runs as graphs (docs/GPU.md "CUDA graphs"): the reads, the update
    // (Dion reads values back inside its update: it runs eagerly) and the writes, over shm and
    // over CUDA regions alike; the update's launch queues one more upload, the step's scalar
    // records.
    const int64_t update_graph = t >= 2 && k.algorithm != AlgorithmKind::kDion ? 1 : 0;
    const int64_t graphs = t >= 2 ? 2 + update_graph : 0;
    EXPECT_EQ(before.graph_launches - start.graph_launches, graphs) << "step " << t;
    EXPECT_EQ(after.graph_launches - before.graph_launches, graphs) << "step " << t;
    EXPECT_EQ(before.async_copies_to_device - start.async_copies_to_device,
              2 * tensors + update_graph)
        << "step " << t;
    EXPECT_EQ(before.async_copies_to_host - start.async_copies_to_host, tensors + groups + 1)
        << "step " << t;
    EXPECT_EQ(after.async_copies_to_device - before.async_copies_to_device, update_graph)
        << "step " << t;
    EXPECT_EQ(after.async_copies_to_host - before.async_copies_to_host, groups + 1) << "step " << t;
    EXPECT_EQ(after.syncs - before.syncs, before.syncs - start.syncs) << "step " << t;
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(gpu->ParamBytes(i), shm->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
    ASSERT_EQ(rg.update_norms_size(), rs.update_norms_size());
    for (const auto& [group, norm] : rs.update_norms()) {
      EXPECT_EQ(rg.update_norms().at(group), norm) << group << ", step " << t;
    }
  }
  EXPECT_NE(gpu->ParamBytes(0), InitialParams(d)[0].data);  // the weights did change
  EXPECT_EQ(State(gpu->id), State(shm->id));  // weights (read back by copies) and state
  // PullParameters reads the CUDA region through a copy too.
  TensorMap pulled;
  ASSERT_TRUE(PullParameters(stub(), gpu->id, &pulled).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    EXPECT_EQ(pulled[d.params[i].name], shm->ParamBytes(i));
  }
  // Both roles' mappings are live until CloseSession releases them.
  const auto open = kt::GetHostTestHandoffCounters();
  if (k.vmm) {
    EXPECT_EQ(open.vmm_mapped_now, baseline_.vmm_mapped_now + 2);
  } else {
    EXPECT_EQ(open.ipc_open_now, baseline_.ipc_open_now + 1);  // one handle, shared
  }
  EXPECT_TRUE(CloseSession(stub(), gpu->id).ok());
  EXPECT_TRUE(CloseSession(stub(), shm->id).ok());
  const auto closed = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(closed.ipc_open_now, baseline_.ipc_open_now);
  EXPECT_EQ(closed.vmm_mapped_now, baseline_.vmm_mapped_now);
}

// "AdamW", "Muon", ... (a test name's part: letters and digits only).
std::string AlgorithmLabel(AlgorithmKind algorithm) {
  std::string a(optim::AlgorithmName(algorithm));
  a.erase(std::remove_if(a.begin(), a.end(), [](char c) { return !std::isalnum(c); }), a.end());
  return a;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const std::string a = AlgorithmLabel(info.param.algorithm);
  return absl::StrCat(a, info.param.vmm ? "_Vmm" : "_Ipc", info.param.async ? "_Async" : "");
}

INSTANTIATE_TEST_SUITE_P(CudaRegions, CudaEqualsShm,
                         ::testing::Values(Case{AlgorithmKind::kAdamW, false, false},
                                           Case{AlgorithmKind::kMuon, false, false},
                                           Case{AlgorithmKind::kDion, false, false},
                                           Case{AlgorithmKind::kLion, false, false},
                                           Case{AlgorithmKind::kAdamW, true, false},
                                           Case{AlgorithmKind::kMuon, true, false},
                                           Case{AlgorithmKind::kDion, true, false},
                                           Case{AlgorithmKind::kMuon, false, true},
                                           Case{AlgorithmKind::kDion, true, true}),
                         CaseName);

TEST_F(CudaRegions, AFailedStepChangesNoWeightByteAndNoState) {
  SessionDesc d = Desc(AlgorithmKind::kMuon);
  d.non_finite = v1::NON_FINITE_POLICY_ERROR;
  auto gpu = CreateCudaSession(d.Request(), /*vmm=*/false);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(SetState(stub(), gpu->id, InitialParams(d)).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    gpu->WriteGrad(i, SyntheticValues(7, 1, i, d.Numel(i)));
  }
  v1::StepResponse r;
  ASSERT_TRUE(Step(gpu->id, 1, 1.0, &r).ok());
  const std::string weights = gpu->Params();
  const TensorMap state = State(gpu->id);
  std::vector<float> bad = SyntheticValues(7, 2, 2, d.Numel(2));
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  gpu->WriteGrad(2, bad);
  for (double scale : {1.0, 0.25}) {  // read in place (f32), and through the widening pass
    grpc::Status s = Step(gpu->id, 2, scale, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "NaN")) << s.error_message();
    EXPECT_EQ(gpu->Params(), weights);
    EXPECT_EQ(State(gpu->id), state);
  }
  // A bad step index: refused before anything runs.
  grpc::Status s = Step(gpu->id, 5, 1.0, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_EQ(gpu->Params(), weights);
  EXPECT_EQ(State(gpu->id), state);
  // The skip policy: the step is answered skipped, and nothing changes either.
  SessionDesc skip = Desc(AlgorithmKind::kDion);
  auto g2 = CreateCudaSession(skip.Request(), /*vmm=*/false);
  ASSERT_NE(g2, nullptr);
  ASSERT_TRUE(SetState(stub(), g2->id, InitialParams(skip)).ok());
  for (size_t i = 0; i < skip.params.size(); ++i) {
    g2->WriteGrad(i, SyntheticValues(7, 1, i, skip.Numel(i)));
  }
  g2->WriteGrad(0, std::vector<float>(static_cast<size_t>(skip.Numel(0)),
                                      std::numeric_limits<float>::infinity()));
  const std::string w2 = g2->Params();
  const TensorMap s2 = State(g2->id);
  ASSERT_TRUE(Step(g2->id, 1, 1.0, &r).ok());
  EXPECT_TRUE(r.skipped());
  EXPECT_EQ(g2->Params(), w2);
  EXPECT_EQ(State(g2->id), s2);
}

TEST_F(CudaRegions, BadRequestsAreRefusedClearlyAndOpenNothing) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  v1::CreateSessionResponse layout;
  ASSERT_TRUE(Create(d.Request(), &layout).ok());
  const std::string id = layout.session_id();
  const int64_t need = layout.param_arena_bytes();
  DeviceMemory mem(*trainer_, 1 << 16);
  const std::string h = mem.IpcHandle();
  auto expect = [&](const v1::RegisterRegionRequest& req, grpc::StatusCode code,
                    const std::vector<std::string>& words) {
    grpc::Status s = Register(req);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    for (const std::string& w : words) {
      EXPECT_TRUE(absl::StrContains(s.error_message(), w))
          << s.error_message() << "\n  lacks: " << w;
    }
    const auto now = kt::GetHostTestHandoffCounters();
    EXPECT_EQ(now.ipc_open_now, baseline_.ipc_open_now) << s.error_message();
    EXPECT_EQ(now.vmm_mapped_now, baseline_.vmm_mapped_now) << s.error_message();
  };
  // A GPU the daemon cannot see: both UUIDs named.
  std::string stranger = UuidBytes(0);
  stranger[3] ^= 0x5a;
  memory::GpuUuid su{}, mine{};
  std::copy(stranger.begin(), stranger.end(), su.begin());
  const std::string u0 = UuidBytes(0);
  std::copy(u0.begin(), u0.end(), mine.begin());
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 0, need, stranger),
         grpc::StatusCode::FAILED_PRECONDITION,
         {memory::FormatGpuUuid(su), memory::FormatGpuUuid(mine)});
  // The daemon's other device: never touched.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 0, need, UuidBytes(1)),
         grpc::StatusCode::FAILED_PRECONDITION, {"is this daemon's device 1"});
  // A handle naming no allocation.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, std::string(64, '\x11'), 0, need),
         grpc::StatusCode::FAILED_PRECONDITION, {});
  // A malformed one.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, std::string(63, '\x11'), 0, need),
         grpc::StatusCode::INVALID_ARGUMENT, {"64 bytes"});
  // Past the allocation's end.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 1 << 15, 1 << 16),
         grpc::StatusCode::OUT_OF_RANGE, {"65536 bytes"});
  // A misaligned offset.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 100, need),
         grpc::StatusCode::INVALID_ARGUMENT, {"multiple of 256"});
  // Smaller than the arena.
  expect(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 0, need - 4),
         grpc::StatusCode::INVALID_ARGUMENT, {"smaller than the PARAMETERS arena"});
  // VMM: a token that the channel never gave, and none at all.
  expect(VmmRequest(id, v1::REGION_ROLE_PARAMETERS, std::string(32, 'a'), 0, need),
         grpc::StatusCode::NOT_FOUND, {});
  expect(VmmRequest(id, v1::REGION_ROLE_PARAMETERS, "", 0, need),
         grpc::StatusCode::INVALID_ARGUMENT, {"fd_token"});
  // A real VMM fd, but a region past the allocation.
  {
    const int fd = kt::HostTestExportVmmFd(0, mem.ptr());
    auto token = client::SendFdToChannel(FdChannel(), fd, client::kFdKindCudaVmm);
    close(fd);
    ASSERT_TRUE(token.ok()) << token.status();
    // Past the allocation (its mapping would exceed it): refused by the import.
    expect(VmmRequest(id, v1::REGION_ROLE_PARAMETERS, *token, 1 << 16, need),
           grpc::StatusCode::FAILED_PRECONDITION, {"exceeds"});
    // The token was spent by that request.
    expect(VmmRequest(id, v1::REGION_ROLE_PARAMETERS, *token, 0, need),
           grpc::StatusCode::FAILED_PRECONDITION, {"already used"});
  }
  // The role already bound.
  std::string region;
  ASSERT_TRUE(Register(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 0, need), &region).ok());
  grpc::Status again = Register(IpcRequest(id, v1::REGION_ROLE_PARAMETERS, h, 0, need));
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << again.error_message();
  EXPECT_TRUE(absl::StrContains(again.error_message(), "already has " + region))
      << again.error_message();
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, baseline_.ipc_open_now + 1);
  // Unregistering releases the mapping.
  {
    auto ctx = Ctx();
    v1::UnregisterRegionRequest req;
    req.set_session_id(id);
    req.set_region_id(region);
    v1::UnregisterRegionResponse resp;
    ASSERT_TRUE(stub().UnregisterRegion(ctx.get(), req, &resp).ok());
  }
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, baseline_.ipc_open_now);
  // Registered again and left bound: the daemon's stop releases it (TearDown checks).
  ASSERT_TRUE(Register(IpcRequest(id, v1::REGION_ROLE_GRADIENTS, h, 0, need)).ok());
  StopDaemon();
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, baseline_.ipc_open_now);
}

TEST_F(CudaRegions, TheSessionStreamWaitsOnTheTrainersEventAndRecordsItsOwn) {
  SessionDesc d = Desc(AlgorithmKind::kMuon);
  d.non_finite = v1::NON_FINITE_POLICY_ERROR;
  auto shm = CreateShmSession(stub(), d.Request());
  auto gpu = CreateCudaSession(d.Request(), /*vmm=*/false);
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(SetState(stub(), shm->id, InitialParams(d)).ok());
  ASSERT_TRUE(SetState(stub(), gpu->id, InitialParams(d)).ok());
  const std::string ready = NewEvent(), done = NewEvent();
  const auto start = kt::GetHostTestHandoffCounters();
  v1::StepResponse r;
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::vector<float> grad = SyntheticValues(5, t, i, d.Numel(i));
      shm->WriteGrad(i, grad);
      gpu->WriteGrad(i, grad);
    }
    ASSERT_TRUE(Step(shm->id, t, 1.0, &r).ok());
    const auto before = kt::GetHostTestHandoffCounters();
    // Asynchronous at step 2: the queued step waits and records on the session stream too.
    grpc::Status s = Step(gpu->id, t, 1.0, &r, /*async=*/t == 2, false, ready, done);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (t == 2) {
      ASSERT_TRUE(Step(gpu->id, t, 0, &r, false, /*wait=*/true).ok());
    }
    const auto after = kt::GetHostTestHandoffCounters();
    // One wait on the trainer's event, one record of the daemon's, per step.
    EXPECT_EQ(after.stream_waits - before.stream_waits, 1) << "step " << t;
    EXPECT_EQ(after.event_records - before.event_records, 1) << "step " << t;
    EXPECT_EQ(Records(done), t);
    EXPECT_EQ(Records(ready), 0) << "the daemon recorded the trainer's event";
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(gpu->ParamBytes(i), shm->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
  }
  // Each event opened once and kept while the trainer names it.
  auto now = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(now.events_opened - start.events_opened, 2);
  EXPECT_EQ(now.events_open_now, start.events_open_now + 2);
  const std::string weights = gpu->Params();
  const TensorMap state = State(gpu->id);
  const int64_t next = kSteps + 1;

  // Bad handles: refused before anything runs (no wait, no op, no record, nothing changed).
  auto refused = [&](const std::string& rdy, const std::string& dn, grpc::StatusCode code,
                     const std::string& words) {
    const auto h0 = kt::GetHostTestHandoffCounters();
    const auto d0 = kt::GetHostTestDeviceCounters();
    grpc::Status s = Step(gpu->id, next, 1.0, &r, false, false, rdy, dn);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), words)) << s.error_message();
    const auto h1 = kt::GetHostTestHandoffCounters();
    EXPECT_EQ(h1.stream_waits, h0.stream_waits);
    EXPECT_EQ(h1.event_records, h0.event_records);
    EXPECT_EQ(kt::GetHostTestDeviceCounters().ops, d0.ops) << "an op ran: " << s.error_message();
  };
  refused(ready.substr(0, 63), done, grpc::StatusCode::INVALID_ARGUMENT,
          "ready_event must be the 64 bytes");
  refused(ready, std::string(64, '\x07'), grpc::StatusCode::FAILED_PRECONDITION,
          "done_event cannot be opened");
  refused(NewEvent(/*device=*/1), done, grpc::StatusCode::FAILED_PRECONDITION,
          "ready_event cannot be opened");
  EXPECT_EQ(gpu->Params(), weights);
  EXPECT_EQ(State(gpu->id), state);

  // A failed step (NaN gradients under the ERROR policy) waited on the trainer's event before
  // it read the gradients, and records nothing: the weights are unchanged.
  std::vector<float> bad = SyntheticValues(5, next, 0, d.Numel(0));
  bad[1] = std::numeric_limits<float>::quiet_NaN();
  gpu->WriteGrad(0, bad);
  auto h0 = kt::GetHostTestHandoffCounters();
  grpc::Status s = Step(gpu->id, next, 1.0, &r, false, false, ready, done);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  auto h1 = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(h1.stream_waits - h0.stream_waits, 1);
  EXPECT_EQ(h1.event_records, h0.event_records);
  EXPECT_EQ(Records(done), kSteps);
  EXPECT_EQ(gpu->Params(), weights);
  EXPECT_EQ(State(gpu->id), state);

  // A new done_event replaces the old one (destroyed), and is the one recorded.
  gpu->WriteGrad(0, SyntheticValues(5, next, 0, d.Numel(0)));
  const std::string done2 = NewEvent();
  h0 = kt::GetHostTestHandoffCounters();
  s = Step(gpu->id, next, 1.0, &r, false, false, ready, done2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  h1 = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(h1.events_destroyed - h0.events_destroyed, 1);
  EXPECT_EQ(h1.events_open_now, h0.events_open_now);
  EXPECT_EQ(Records(done2), 1);
  EXPECT_EQ(Records(done), kSteps);
  // A replay of that step records nothing again.
  s = Step(gpu->id, next, 1.0, &r, false, false, ready, done2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(r.replayed());
  EXPECT_EQ(Records(done2), 1);
  // CloseSession destroys the session's events (TearDown checks the live count too).
  EXPECT_TRUE(CloseSession(stub(), gpu->id).ok());
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now);
}

TEST_F(CudaRegions, ASkippedStepRecordsTheDoneEventAndAWorldSessionTakesEventsToo) {
  auto gpu = CreateCudaSession(Desc(AlgorithmKind::kAdamW).Request(), /*vmm=*/true);
  ASSERT_NE(gpu, nullptr);
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  ASSERT_TRUE(SetState(stub(), gpu->id, InitialParams(d)).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    gpu->WriteGrad(i, std::vector<float>(static_cast<size_t>(d.Numel(i)),
                                         std::numeric_limits<float>::infinity()));
  }
  const std::string weights = gpu->Params();
  const std::string ready = NewEvent(), done = NewEvent();
  v1::StepResponse r;
  grpc::Status s = Step(gpu->id, 1, 1.0, &r, false, false, ready, done);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(r.skipped());
  EXPECT_EQ(Records(done), 1);  // the trainer may go on: its weights are as they were
  EXPECT_EQ(gpu->Params(), weights);
  // A world session (of one, over shm) orders its stream with the trainer's events as a local
  // one does: one wait, one record.
  v1::CreateSessionRequest req = d.Request();
  req.set_world_key("cuda-region-events");
  auto world = CreateShmSession(stub(), req);
  ASSERT_NE(world, nullptr);
  ASSERT_TRUE(SetState(stub(), world->id, InitialParams(d)).ok());
  WriteSyntheticGrads(world.get(), d, 7, 1);
  const auto h0 = kt::GetHostTestHandoffCounters();
  s = Step(world->id, 1, 1.0, &r, false, false, ready, done);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(r.skipped());
  const auto h1 = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(h1.stream_waits - h0.stream_waits, 1);
  EXPECT_EQ(h1.event_records - h0.event_records, 1);
  EXPECT_EQ(Records(done), 2);
}

// ---- World sessions over CUDA regions (docs/GPU.md "World sessions") ----
// Two daemons in this process form a world of two on TEST device 0 (the hand-off emulation is
// same-process only), over loopback TCP (the Peer service, the world secret) and Gloo. On both
// ranks one world session steps over CUDA regions (rank 0 a legacy IPC handle, rank 1 VMM fds
// over the fd channel) with the trainer's ready_event and done_event, and its twin world session
// (another world_key, same weights and gradients) over shm. After every step each rank's CUDA
// arena must equal its shm arena bit for bit, with the same update norms, world bytes and
// skip decisions; each step waits once on each rank's ready_event and records its done_event
// once; GetState equals at the end; the checksums (--checksum_every=2) run on the device.
struct WorldRegionRun {
  AlgorithmKind algorithm;
  v1::GradientSync sync;
};

class CudaRegionWorld : public ::testing::TestWithParam<WorldRegionRun>, protected CudaWorld {
 protected:
  static void SetUpTestSuite() { RegisterStrictTestDevice(); }
  void SetUp() override { StartWorld("/tmp/diond-cuda-world-"); }
  void TearDown() override { StopWorld(); }

  grpc::Status StepWithEvents(int r, const std::string& id, int64_t index, v1::StepResponse* resp,
                              const std::string& ready, const std::string& done) {
    auto ctx = Ctx();
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_step_index(index);
    req.set_ready_event(ready);
    req.set_done_event(done);
    return stub(r).Step(ctx.get(), req, resp);
  }
};

TEST_P(CudaRegionWorld, EqualsTheShmWorldBitForBitWithTheTrainersEvents) {
  const WorldRegionRun run = GetParam();
  SessionDesc d = Desc(run.algorithm);
  if (run.algorithm == AlgorithmKind::kDion) {  // a compact P / Q_new exchange
    d.groups[0].proto.mutable_hyperparameters()->set_rank_fraction(0.25);
    d.groups[0].config.hyperparams.rank_fraction = 0.25;
  }
  const std::string label =
      absl::StrCat(static_cast<int>(run.algorithm), "-", static_cast<int>(run.sync));
  v1::CreateSessionRequest shm_req = d.Request(), gpu_req = d.Request();
  shm_req.set_gradient_sync(run.sync);
  gpu_req.set_gradient_sync(run.sync);
  shm_req.set_world_key("shm-" + label);
  gpu_req.set_world_key("cuda-" + label);
  std::vector<std::unique_ptr<ShmSession>> shm(kWorld);
  std::vector<std::unique_ptr<CudaSession>> gpu(kWorld);
  OnAllRanks([&](int r) { shm[r] = CreateShmSession(stub(r), shm_req); });
  OnAllRanks([&](int r) {
    gpu[r] = CreateCudaSession(stub(r), daemons_[r]->fd_channel_path(), *trainer_, gpu_req,
                               /*vmm=*/r == 1);
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_NE(shm[r], nullptr) << r;
    ASSERT_NE(gpu[r], nullptr) << r;
    // A world device session offers the CUDA kinds.
    EXPECT_TRUE(HasKind(gpu[r]->layout, v1::REGION_KIND_CUDA_IPC)) << r;
    EXPECT_TRUE(HasKind(gpu[r]->layout, v1::REGION_KIND_CUDA_VMM_FD)) << r;
    ASSERT_TRUE(SetState(stub(r), shm[r]->id, InitialParams(d)).ok());
    ASSERT_TRUE(SetState(stub(r), gpu[r]->id, InitialParams(d)).ok());
  }
  std::vector<std::string> ready, done;
  for (int r = 0; r < kWorld; ++r) {
    ready.push_back(NewEvent());
    done.push_back(NewEvent());
  }
  const bool replicated = run.sync == v1::GRADIENT_SYNC_REPLICATED;
  constexpr int64_t kWorldSteps = 4, kNanStep = 3;
  std::string before_nan[kWorld];
  for (int64_t t = 1; t <= kWorldSteps; ++t) {
    for (int r = 0; r < kWorld; ++r) {
      const uint64_t seed = replicated ? 7 : 7 + static_cast<uint64_t>(r);
      for (size_t i = 0; i < d.params.size(); ++i) {
        std::vector<float> grad = SyntheticValues(seed, t, i, d.Numel(i));
        // Step 3: a NaN (on rank 1 only where the gradients are the ranks' own): skipped on all.
        if (t == kNanStep && i == 0 && (replicated || r == 1)) {
          grad[2] = std::numeric_limits<float>::quiet_NaN();
        }
        shm[r]->WriteGrad(i, grad);
        gpu[r]->WriteGrad(i, grad);
      }
      if (t == kNanStep) before_nan[r] = gpu[r]->Params();
    }
    std::vector<v1::StepResponse> rs(kWorld), rg(kWorld);
    OnAllRanks([&](int r) {
      grpc::Status st = DoStep(stub(r), shm[r]->id, t, &rs[r]);
      EXPECT_TRUE(st.ok()) << "shm rank " << r << " step " << t << ": " << st.error_message();
    });
    const auto h0 = kt::GetHostTestHandoffCounters();
    OnAllRanks([&](int r) {
      grpc::Status st = StepWithEvents(r, gpu[r]->id, t, &rg[r], ready[r], done[r]);
      EXPECT_TRUE(st.ok()) << "cuda rank " << r << " step " << t << ": " << st.error_message();
    });
    const auto h1 = kt::GetHostTestHandoffCounters();
    // One wait on each rank's ready_event and one record of its done_event, skipped or not.
    EXPECT_EQ(h1.stream_waits - h0.stream_waits, kWorld) << "step " << t;
    EXPECT_EQ(h1.event_records - h0.event_records, kWorld) << "step " << t;
    for (int r = 0; r < kWorld; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r, ", step ", t));
      EXPECT_EQ(Records(done[r]), t);
      EXPECT_EQ(Records(ready[r]), 0) << "the daemon recorded the trainer's event";
      EXPECT_EQ(rg[r].skipped(), t == kNanStep);
      EXPECT_EQ(rs[r].skipped(), t == kNanStep);
      EXPECT_EQ(rg[r].world_bytes_sent(), rs[r].world_bytes_sent());
      for (size_t i = 0; i < d.params.size(); ++i) {
        EXPECT_EQ(gpu[r]->ParamBytes(i), shm[r]->ParamBytes(i)) << d.params[i].name;
      }
      if (t == kNanStep) {
        EXPECT_EQ(gpu[r]->Params(), before_nan[r]);
      }
      ASSERT_EQ(rg[r].update_norms_size(), rs[r].update_norms_size());
      for (const auto& [group, norm] : rs[r].update_norms()) {
        EXPECT_EQ(rg[r].update_norms().at(group), norm) << group;
      }
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_NE(gpu[r]->ParamBytes(0), InitialParams(d)[0].data) << r;  // the weights did change
    TensorMap a, b;
    ASSERT_TRUE(GetState(stub(r), gpu[r]->id, true, &a).ok());
    ASSERT_TRUE(GetState(stub(r), shm[r]->id, true, &b).ok());
    EXPECT_EQ(a, b) << "rank " << r;
  }
  // Every replica holds the same weights (the exchange wrote the owners' values everywhere).
  if (replicated || run.sync == v1::GRADIENT_SYNC_AVERAGE) {
    EXPECT_EQ(gpu[0]->Params(), gpu[1]->Params());
  }
  OnAllRanks([&](int r) {
    EXPECT_TRUE(CloseSession(stub(r), gpu[r]->id).ok());
    EXPECT_TRUE(CloseSession(stub(r), shm[r]->id).ok());
  });
}

std::string WorldRunName(const ::testing::TestParamInfo<WorldRegionRun>& info) {
  const std::string a = AlgorithmLabel(info.param.algorithm);
  const v1::GradientSync s = info.param.sync;
  return a + (s == v1::GRADIENT_SYNC_REPLICATED ? "Replicated"
              : s == v1::GRADIENT_SYNC_AVERAGE  ? "Average"
                                                : "DionCompressed");
}

INSTANTIATE_TEST_SUITE_P(
    CudaRegions, CudaRegionWorld,
    ::testing::Values(WorldRegionRun{AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRegionRun{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRegionRun{AlgorithmKind::kDion, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRegionRun{AlgorithmKind::kDion, v1::GRADIENT_SYNC_DION_COMPRESSED}),
    WorldRunName);

}  // namespace
}  // namespace diond::service_testing
