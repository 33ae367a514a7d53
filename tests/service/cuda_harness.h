// The trainer's side of CUDA regions for the service suites that run a daemon in their own
// process on the strict TEST backend (kernels/testing/host_device_backend.h): its "GPU memory",
// its IPC handles and events, a session over CUDA regions, and the fixture (the daemon, the
// hand-off counters checked at the end). The TEST backend's hand-off emulation works within one
// process only: the daemon must run in the test's.
#ifndef DIOND_TESTS_SERVICE_CUDA_HARNESS_H_
#define DIOND_TESTS_SERVICE_CUDA_HARNESS_H_

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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
#include "tests/service/service_harness.h"

namespace diond::service_testing {

namespace kt = ::diond::kernels::testing;

inline constexpr kernels::Device kDev0{kernels::DeviceType::kTest, 0};

inline std::string UuidBytes(int device) {
  const auto u = kt::HostTestDeviceUuid(device);
  return std::string(reinterpret_cast<const char*>(u.data()), u.size());
}

// "GPU memory" of the trainer: one TEST allocation (strict: the host cannot touch it), written
// and read through the backend's explicit copies.
class DeviceMemory {
 public:
  DeviceMemory(const kernels::Context& ctx, size_t bytes) : ctx_(ctx), bytes_(bytes) {
    char err[256] = {0};
    DiondOpsCall call{0, nullptr, err, sizeof(err)};
    EXPECT_EQ(kt::HostTestDeviceOps()->allocate(&call, bytes, &ptr_), DIOND_OPS_OK) << err;
  }
  ~DeviceMemory() {
    if (ptr_ != nullptr) kt::HostTestDeviceOps()->deallocate(0, nullptr, ptr_, 0);
  }
  uint8_t* ptr() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return bytes_; }
  void Write(int64_t offset, const std::string& bytes) {
    EXPECT_TRUE(
        ctx_.backend().copy_from_host(ctx_, bytes.data(), ptr() + offset, bytes.size()).ok());
  }
  std::string Read(int64_t offset, int64_t len) const {
    std::string out(static_cast<size_t>(len), '\0');
    EXPECT_TRUE(ctx_.backend().copy_to_host(ctx_, ptr() + offset, out.data(), out.size()).ok());
    return out;
  }
  // The allocation's legacy IPC handle, exported once (as cudaIpcGetMemHandle names an
  // allocation by one handle): both roles' regions name it.
  const std::string& IpcHandle() {
    if (handle_.empty()) {
      handle_.assign(DIOND_CUDA_IPC_HANDLE_BYTES, '\0');
      EXPECT_TRUE(
          kt::HostTestExportIpcMemHandle(0, ptr_, reinterpret_cast<uint8_t*>(handle_.data())));
    }
    return handle_;
  }

 private:
  const kernels::Context& ctx_;
  size_t bytes_;
  void* ptr_ = nullptr;
  std::string handle_;
};

inline v1::RegisterRegionRequest IpcRequest(const std::string& session, v1::RegionRole role,
                                            const std::string& handle, int64_t offset, int64_t size,
                                            const std::string& uuid = UuidBytes(0)) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_CUDA_IPC);
  v1::CudaIpcRegion* r = req.mutable_cuda_ipc();
  r->set_mem_handle(handle);
  r->set_gpu_uuid(uuid);
  r->set_offset_bytes(offset);
  r->set_size_bytes(size);
  return req;
}

inline v1::RegisterRegionRequest VmmRequest(const std::string& session, v1::RegionRole role,
                                            const std::string& token, int64_t offset,
                                            int64_t size) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_CUDA_VMM_FD);
  v1::CudaVmmFdRegion* r = req.mutable_cuda_vmm_fd();
  r->set_gpu_uuid(UuidBytes(0));
  r->set_offset_bytes(offset);
  r->set_size_bytes(size);
  r->set_granularity_bytes(static_cast<int64_t>(kt::kHostTestVmmGranularity));
  r->set_fd_token(token);
  return req;
}

// A session whose arenas lie in the trainer's TEST "GPU memory": one allocation, the
// PARAMETERS arena at 0 and the GRADIENTS arena at grad_base.
struct CudaSession {
  std::string id;
  v1::CreateSessionResponse layout;
  std::unique_ptr<DeviceMemory> mem;
  int64_t grad_base = 0;
  std::string param_region, grad_region;
  const v1::TensorLayout& tensor(size_t i) const { return layout.layout(static_cast<int>(i)); }
  std::string ParamBytes(size_t i) const {
    return mem->Read(tensor(i).param_offset_bytes(), tensor(i).size_bytes());
  }
  std::string Params() const { return mem->Read(0, layout.param_arena_bytes()); }
  void WriteGrad(size_t i, const std::vector<float>& g) {
    mem->Write(grad_base + tensor(i).grad_offset_bytes(), FloatBytes(g));
  }
};

inline grpc::Status RegisterRegion(v1::Optimizer::Stub& stub, const v1::RegisterRegionRequest& req,
                                   std::string* id = nullptr) {
  auto ctx = Ctx();
  v1::RegisterRegionResponse resp;
  grpc::Status s = stub.RegisterRegion(ctx.get(), req, &resp);
  if (id != nullptr) *id = resp.region_id();
  return s;
}

// CreateSession on `stub`, one TEST allocation of the trainer (`trainer`, its Context), both
// roles registered (CUDA_IPC: one handle for both; VMM: the allocation exported twice, each fd
// over the daemon's fd channel `fd_channel`). ADD_FAILUREs and returns null on error.
inline std::unique_ptr<CudaSession> CreateCudaSession(v1::Optimizer::Stub& stub,
                                                      const std::string& fd_channel,
                                                      const kernels::Context& trainer,
                                                      const v1::CreateSessionRequest& req,
                                                      bool vmm) {
  auto c = std::make_unique<CudaSession>();
  auto cctx = Ctx();
  grpc::Status s = stub.CreateSession(cctx.get(), req, &c->layout);
  if (!s.ok()) {
    ADD_FAILURE() << s.error_message();
    return nullptr;
  }
  c->id = c->layout.session_id();
  c->grad_base = (c->layout.param_arena_bytes() + 4095) / 4096 * 4096;
  const int64_t g = static_cast<int64_t>(kt::kHostTestVmmGranularity);
  const int64_t bytes = (c->grad_base + c->layout.grad_arena_bytes() + g - 1) / g * g;
  c->mem = std::make_unique<DeviceMemory>(trainer, static_cast<size_t>(bytes));
  auto reg = [&](v1::RegionRole role, int64_t offset, int64_t size, std::string* id) {
    if (!vmm) {
      return RegisterRegion(stub, IpcRequest(c->id, role, c->mem->IpcHandle(), offset, size), id);
    }
    const int fd = kt::HostTestExportVmmFd(0, c->mem->ptr());
    EXPECT_GE(fd, 0);
    auto token = client::SendFdToChannel(fd_channel, fd, client::kFdKindCudaVmm);
    close(fd);
    EXPECT_TRUE(token.ok()) << token.status();
    return RegisterRegion(stub, VmmRequest(c->id, role, token.ok() ? *token : "", offset, size),
                          id);
  };
  s = reg(v1::REGION_ROLE_PARAMETERS, 0, c->layout.param_arena_bytes(), &c->param_region);
  if (s.ok()) {
    s = reg(v1::REGION_ROLE_GRADIENTS, c->grad_base, c->layout.grad_arena_bytes(), &c->grad_region);
  }
  if (!s.ok()) {
    ADD_FAILURE() << s.error_message();
    return nullptr;
  }
  return c;
}

// The TEST backend as DeviceType::kTest's ops, strict (the daemons' and the trainer's "GPU
// memory" faults on any host access outside the backend's entries).
inline void RegisterStrictTestDevice() {
  kernels::UnregisterOpsBackendForTest(kernels::DeviceType::kTest);
  ASSERT_TRUE(kernels::RegisterPluginOps(kernels::DeviceType::kTest, kt::HostTestDeviceOps()).ok());
  kt::ResetHostTestDevice(0);
  kt::SetHostTestDeviceStrict(true);
}

// The trainer's Context on TEST device 0.
inline std::unique_ptr<kernels::Context> TrainerContext() {
  kernels::ContextOptions co;
  co.device = kDev0;
  co.num_threads = 1;
  auto ctx = kernels::Context::Create(co);
  EXPECT_TRUE(ctx.ok()) << ctx.status();
  return ctx.ok() ? *std::move(ctx) : nullptr;
}

// What every fixture here starts from and checks at the end: the hand-off counters and live
// regions before, a scratch folder, and nothing the daemons opened left open once they stopped.
class Handoffs {
 protected:
  void BeginHandoffs(const std::string& folder_prefix) {
    baseline_ = kt::GetHostTestHandoffCounters();
    live_ = memory::CudaRegion::LiveCount();
    std::string tmpl = folder_prefix + "XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  // Call after the daemons stopped.
  void EndHandoffs() {
    const auto now = kt::GetHostTestHandoffCounters();
    EXPECT_EQ(now.ipc_open_now, baseline_.ipc_open_now);
    EXPECT_EQ(now.vmm_mapped_now, baseline_.vmm_mapped_now);
    EXPECT_EQ(now.events_open_now, baseline_.events_open_now);
    EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
    if (!dir_.empty()) std::system(absl::StrCat("rm -rf '", dir_, "'").c_str());
  }

  std::string dir_;
  kt::HostTestHandoffCounters baseline_;
  int64_t live_ = 0;
};

class CudaRegions : public ::testing::Test, protected Handoffs {
 protected:
  static void SetUpTestSuite() { RegisterStrictTestDevice(); }

  void SetUp() override {
    BeginHandoffs("/tmp/diond-cuda-svc-");
    server::DaemonOptions o;
    auto listen = rpc::ParseListenAddresses(absl::StrCat("unix:", dir_, "/d.sock"));
    ASSERT_TRUE(listen.ok()) << listen.status();
    o.listen = *listen;
    o.device.mode = kernels::DeviceRequest::Mode::kCpu;
    o.registered_device = kernels::Device{kernels::DeviceType::kTest, 0};
    auto d = server::Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    channel_ = grpc::CreateChannel(absl::StrCat("unix:", dir_, "/d.sock"),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Optimizer::NewStub(channel_);
    trainer_ = TrainerContext();
    ASSERT_NE(trainer_, nullptr);
  }

  void TearDown() override {
    StopDaemon();
    EndHandoffs();
  }

  void StopDaemon() {
    stub_.reset();
    channel_.reset();
    if (daemon_ != nullptr) daemon_->Shutdown(absl::Seconds(5));
    daemon_.reset();
  }

  v1::Optimizer::Stub& stub() { return *stub_; }
  std::string FdChannel() const { return daemon_->fd_channel_path(); }

  grpc::Status Register(const v1::RegisterRegionRequest& req, std::string* id = nullptr) {
    return RegisterRegion(stub(), req, id);
  }

  grpc::Status Create(const v1::CreateSessionRequest& req, v1::CreateSessionResponse* resp) {
    auto ctx = Ctx();
    return stub().CreateSession(ctx.get(), req, resp);
  }

  std::unique_ptr<CudaSession> CreateCudaSession(const v1::CreateSessionRequest& req, bool vmm) {
    return service_testing::CreateCudaSession(stub(), FdChannel(), *trainer_, req, vmm);
  }

  grpc::Status Step(const std::string& id, int64_t index, double scale, v1::StepResponse* resp,
                    bool async = false, bool wait = false, const std::string& ready = "",
                    const std::string& done = "") {
    auto ctx = Ctx();
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_step_index(index);
    req.set_gradient_scale(scale);
    req.set_asynchronous(async);
    req.set_wait(wait);
    req.set_ready_event(ready);
    req.set_done_event(done);
    return stub().Step(ctx.get(), req, resp);
  }

  TensorMap State(const std::string& id) {
    TensorMap m;
    grpc::Status s = GetState(stub(), id, true, &m);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return m;
  }

  std::unique_ptr<server::Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  std::unique_ptr<kernels::Context> trainer_;
};

// A world of kWorld daemons in this process on TEST device 0 (the hand-off emulation is
// same-process only), over loopback TCP (the Peer service, the world secret) and Gloo, with
// --checksum_every=2; a trainer context for their CUDA regions.
inline constexpr int kWorld = 2;
class CudaWorld : protected Handoffs {
 protected:
  void StartWorld(const std::string& folder_prefix) {
    BeginHandoffs(folder_prefix);
    const std::string secret = dir_ + "/world.secret", tokens = dir_ + "/tokens";
    WriteText(secret, kWorldSecret);
    WriteText(tokens, absl::StrCat(kTcpToken, " svc-test admin\n"));
    for (int r = 0; r < kWorld; ++r) {
      server::DaemonOptions o;
      auto listen =
          rpc::ParseListenAddresses(absl::StrCat("unix:", dir_, "/d", r, ".sock,127.0.0.1:0"));
      ASSERT_TRUE(listen.ok()) << listen.status();
      o.listen = *listen;
      o.auth_token_file = tokens;
      o.world_secret_file = secret;
      o.device.mode = kernels::DeviceRequest::Mode::kCpu;
      o.registered_device = kernels::Device{kernels::DeviceType::kTest, 0};
      o.sessions.checksum_every = 2;
      o.world.world_size = kWorld;
      o.world.rank = r;
      o.world.heartbeat_interval = absl::Milliseconds(200);
      o.world.peer_timeout = absl::Seconds(5);
      if (r > 0) {
        int port = 0;
        for (const auto& a : daemons_[0]->bound()) {
          if (a.kind == rpc::ListenAddress::Kind::kTcp) port = a.port;
        }
        ASSERT_NE(port, 0);
        o.world.coordinator = absl::StrCat("127.0.0.1:", port);
      }
      auto d = server::Daemon::Start(o);
      ASSERT_TRUE(d.ok()) << d.status();
      daemons_.push_back(*std::move(d));
      channels_.push_back(grpc::CreateChannel(absl::StrCat("unix:", dir_, "/d", r, ".sock"),
                                              grpc::InsecureChannelCredentials()));
      stubs_.push_back(v1::Optimizer::NewStub(channels_.back()));
    }
    trainer_ = TrainerContext();
    ASSERT_NE(trainer_, nullptr);
  }

  void StopWorld() {
    stubs_.clear();
    channels_.clear();
    for (auto it = daemons_.rbegin(); it != daemons_.rend(); ++it) {
      (*it)->Shutdown(absl::Seconds(5));
    }
    daemons_.clear();
    EndHandoffs();
  }

  static void OnAllRanks(const std::function<void(int)>& f) {
    std::vector<std::thread> t;
    for (int r = 0; r < kWorld; ++r) t.emplace_back(f, r);
    for (auto& th : t) th.join();
  }

  v1::Optimizer::Stub& stub(int r) { return *stubs_[static_cast<size_t>(r)]; }

  std::vector<std::unique_ptr<server::Daemon>> daemons_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::Optimizer::Stub>> stubs_;
  std::unique_ptr<kernels::Context> trainer_;
};

// The trainer's side of an interprocess event (cudaEventCreate + cudaIpcGetEventHandle).
inline std::string NewEvent(int device = 0) {
  std::string h(DIOND_CUDA_IPC_HANDLE_BYTES, '\0');
  EXPECT_TRUE(kt::HostTestCreateIpcEvent(device, reinterpret_cast<uint8_t*>(h.data())));
  return h;
}
inline int64_t Records(const std::string& event) {
  return kt::HostTestEventRecords(reinterpret_cast<const uint8_t*>(event.data()));
}
inline int64_t Waits(const std::string& event) {
  return kt::HostTestEventWaits(reinterpret_cast<const uint8_t*>(event.data()));
}

}  // namespace diond::service_testing

#endif  // DIOND_TESTS_SERVICE_CUDA_HARNESS_H_
