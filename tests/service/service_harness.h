// Test harness of the Optimizer service suites (tests/service): starts the real `diond` binary
// on a temporary Unix socket (optionally also on a loopback TCP port), creates and maps real
// POSIX shared-memory segments as a trainer would, and wraps the streaming RPCs (SetState,
// GetState, PushGradients, PullParameters) so that tests can say what they send in a line.
//
// It also replays sessions in-process: `Replay` builds one optim::GroupOptimizer per group, as
// server/session/session.cc does, so a test can require the daemon's bytes to equal the
// in-process bytes exactly.
//
// Thread-safety: a Daemon's stub may be used from several threads (gRPC stubs are thread-safe);
// ShmSegment and Replay are not thread-safe.
#ifndef DIOND_TESTS_SERVICE_SERVICE_HARNESS_H_
#define DIOND_TESTS_SERVICE_SERVICE_HARNESS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/context.h"
#include "kernels/optim/group_optimizer.h"
#include "tests/integration/subprocess.h"

namespace diond::service_testing {

namespace v1 = ::diond::v1;

// Every RPC of the suites gets this deadline, so a hung daemon fails a test instead of hanging it.
inline constexpr int kRpcDeadlineSeconds = 60;

// The credentials Daemon::Start gives daemons by default (see Start).
inline constexpr char kTcpToken[] = "svc-test-admin-token-0123456789";
// Writes `text` to `path` (mode 0600: a secret or token file the daemon reads).
void WriteText(const std::string& path, const std::string& text);
inline constexpr char kWorldSecret[] = "svc-test-world-secret-0123456789";

// A channel that sends "authorization: Bearer <token>" on every call (no credential when
// `token` is empty).
std::shared_ptr<grpc::Channel> TokenChannel(
    const std::string& target, const std::string& token,
    const std::shared_ptr<grpc::ChannelCredentials>& creds = grpc::InsecureChannelCredentials());

// A client context with the suite's deadline.
std::unique_ptr<grpc::ClientContext> Ctx();

class Daemon {
 public:
  // Starts diond with --listen=unix:<tmp>/d.sock[,127.0.0.1:0] --metrics_address=
  // --device=cpu --ready_file=<tmp>/ready.json plus `flags`, and polls for the ready file (60 s
  // deadline). Returns nullptr (after ADD_FAILURE with the log) if it does not become ready.
  // `dir` reuses a directory (a restart after a crash); empty = a fresh temporary one.
  // With `tcp`, the daemon also gets --auth_token_file with kTcpToken (an admin token) unless
  // `flags` name one; a world (--world_size) gets --world_secret_file with kWorldSecret unless
  // `flags` name one.
  static std::unique_ptr<Daemon> Start(const std::vector<std::string>& flags = {}, bool tcp = false,
                                       const std::string& dir = "");
  // The same with another daemon binary (e.g. the test-only diond_testdevice) and extra
  // environment variables ("NAME=value"); `tcp` as for Start.
  static std::unique_ptr<Daemon> StartBinary(const std::string& binary,
                                             const std::vector<std::string>& flags = {},
                                             const std::vector<std::string>& env = {},
                                             bool tcp = false);

  v1::Optimizer::Stub& stub() { return *stub_; }
  // A stub on the loopback TCP port that sends "authorization: Bearer <token>" on every call
  // (kTcpToken by default; empty = no credential).
  std::unique_ptr<v1::Optimizer::Stub> NewTcpStub(const std::string& token = kTcpToken) const;
  // grpc.health.v1 Check of "diond.v1.Optimizer" answers SERVING.
  bool Serving() const;
  pid_t pid() const { return proc_->pid(); }
  // The loopback TCP port (started with tcp = true), e.g. rank 0's address for --coordinator.
  int tcp_port() const { return tcp_port_; }
  // The metrics port, when `flags` gave --metrics_address (the harness's default has none).
  int metrics_port() const { return metrics_port_; }
  const std::string& dir() const { return dir_; }
  std::string Log() const { return proc_->Log(); }
  // SIGKILL and reap.
  void Kill();
  // SIGTERM (the daemon drains and exits) and reap: the exit status, nullopt if it did not exit
  // within `timeout`.
  std::optional<int> Terminate(absl::Duration timeout);
  // The daemon process is still alive.
  bool Alive();

 private:
  Daemon() = default;
  // Start's body: `prefix` is the command before the flags (the binary, or env + the binary).
  static std::unique_ptr<Daemon> Launch(std::vector<std::string> prefix,
                                        const std::vector<std::string>& flags, bool tcp,
                                        const std::string& dir);
  std::unique_ptr<testing::Subprocess> proc_;
  std::string dir_, socket_;
  int tcp_port_ = 0;
  int metrics_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
};

// The counters of the last "test device counters: k=v ..." line of a test-device daemon's log
// (tests/service/test_device_daemon.cc), as k -> v; empty when the log has none.
std::map<std::string, int64_t> LastCounters(const Daemon& d);

// A POSIX shm segment created (O_EXCL) and mapped by the test, unlinked and unmapped on
// destruction. Names carry kShmPrefix and the test's pid so that leaks can be found by name.
inline constexpr char kShmPrefix[] = "diond-svc-test-";
class ShmSegment {
 public:
  static std::unique_ptr<ShmSegment> Create(int64_t bytes);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }  // without the leading '/'
  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  std::string Bytes(int64_t offset, int64_t len) const;
  std::string AllBytes() const { return Bytes(0, size_); }
  void Write(int64_t offset, const std::string& bytes);
  // ftruncate of the segment (a hostile trainer shrinking it under the daemon); the test's own
  // mapping keeps its size, so the test must not touch bytes past `bytes` afterwards.
  bool Truncate(int64_t bytes);

 private:
  ShmSegment() = default;
  std::string name_;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};
// Names of this process's segments still present in /dev/shm.
std::vector<std::string> LeftoverShmSegments();

// ---- bytes -------------------------------------------------------------------------------------
std::string FloatBytes(const std::vector<float>& v);
// bf16 bytes of `v` (the upper half of each float: any bf16 value will do).
std::string Bf16Bytes(const std::vector<float>& v);
std::vector<float> BytesToFloats(const std::string& bytes);
uint64_t Fnv1a(const std::string& bytes);

// ---- streaming RPCs ----------------------------------------------------------------------------
struct Chunk {
  std::string name;
  int64_t offset = 0;
  std::string data;
};
// `bytes` of tensor `name` in chunks of at most `chunk_bytes`.
std::vector<Chunk> SplitTensor(const std::string& name, const std::string& bytes,
                               int64_t chunk_bytes = 4 << 20);
// Sends `chunks` (the first carries `session`; an empty `session` sends none), then WritesDone.
grpc::Status SetState(v1::Optimizer::Stub& stub, const std::string& session,
                      const std::vector<Chunk>& chunks, v1::SetStateResponse* resp = nullptr);
grpc::Status PushGradients(v1::Optimizer::Stub& stub, const std::string& session,
                           const std::vector<Chunk>& chunks,
                           v1::PushGradientsResponse* resp = nullptr);
// Reassembles the streamed tensors into name -> bytes, checking that chunks are contiguous.
using TensorMap = std::map<std::string, std::string>;
grpc::Status GetState(v1::Optimizer::Stub& stub, const std::string& session,
                      bool include_parameters, TensorMap* out);
grpc::Status PullParameters(v1::Optimizer::Stub& stub, const std::string& session, TensorMap* out,
                            int64_t chunk_bytes = 0, const std::vector<std::string>& names = {});

// ---- sessions ----------------------------------------------------------------------------------
struct GroupDesc {
  v1::ParameterGroup proto;   // what the client sends
  optim::GroupConfig config;  // the same group for the in-process replay
};
struct ParamDesc {
  std::string name;
  std::vector<int64_t> shape;
  std::string group;
};
struct SessionDesc {
  std::vector<GroupDesc> groups;
  std::vector<ParamDesc> params;
  v1::NonFinitePolicy non_finite = v1::NON_FINITE_POLICY_UNSPECIFIED;
  v1::CreateSessionRequest Request() const;
  int64_t Numel(size_t param) const;
};
// A group of `algorithm` with the reference defaults and `lr`, fp32 precision.
GroupDesc MakeGroup(const std::string& name, optim::AlgorithmKind algorithm, double lr);
v1::Algorithm AlgorithmToProto(optim::AlgorithmKind kind);

// Deterministic pseudo-random values in [-1, 1): the gradients of synthetic sessions, a pure
// function of (seed, step, param, element) so a replay regenerates them.
std::vector<float> SyntheticValues(uint64_t seed, int64_t step, size_t param, int64_t n);
// Every parameter of `d` as one chunk of SyntheticValues(seed, step 0): the initial weights.
std::vector<Chunk> SyntheticWeights(const SessionDesc& d, uint64_t seed);
// Two matrices "w" (24x16) and "u" (16x24) in group "main" of `algorithm` (lr 0.01) and a bias
// "b" (16) in AdamW group "vec" (lr 0.001): the session of the TEST-device service tests.
SessionDesc TwoMatricesAndABias(optim::AlgorithmKind algorithm);

// ---- checkpoints -------------------------------------------------------------------------------
// The steps of the step-<N> directories in `dir` (a session's checkpoint folder), sorted, as
// LatestCheckpoint sees them; the names of its other entries go to `others` when given.
std::vector<int64_t> CheckpointSteps(const std::string& dir,
                                     std::vector<std::string>* others = nullptr);
// LoadCheckpoint of `path`.
grpc::Status LoadCheckpointFrom(v1::Optimizer::Stub& stub, const std::string& path,
                                v1::LoadCheckpointResponse* resp);
// How many sessions ListSessions shows (a failed call is a test failure and counts 0).
size_t SessionCount(v1::Optimizer::Stub& stub);

// The session's optimizers run in this process (fp32 parameters).
class Replay {
 public:
  static absl::StatusOr<std::unique_ptr<Replay>> Create(const SessionDesc& desc);
  std::vector<std::vector<float>>& params() { return params_; }
  absl::Status SetState(size_t param, const std::string& state, const std::vector<float>& v);
  absl::StatusOr<std::vector<float>> GetState(size_t param, const std::string& state) const;
  std::vector<std::string> StateNames(size_t param) const;
  // One step over every group, in declaration order (as Session::Step does).
  absl::Status Step(const kernels::Context& ctx, const std::vector<std::vector<float>>& grads);
  // The same, where no_grad[i] means "parameter i has no gradient" (a null gradient, as the
  // session passes for StepRequest.params_without_grad).
  absl::Status Step(const kernels::Context& ctx, const std::vector<std::vector<float>>& grads,
                    const std::vector<bool>& no_grad);

 private:
  struct Group {
    std::unique_ptr<optim::GroupOptimizer> opt;
    std::vector<size_t> params;
  };
  std::vector<Group> groups_;
  std::vector<size_t> group_of_, slot_of_;
  std::vector<std::vector<float>> params_;
  int64_t steps_ = 0;
};

// A session bound to shm: one segment holding the parameter arena at offset 0 and the gradient
// arena after it (both 256-aligned), or two segments when `two_segments`.
struct ShmSession {
  std::string id;
  v1::CreateSessionResponse layout;
  std::unique_ptr<ShmSegment> params_seg, grads_seg;  // grads_seg null for one segment
  int64_t grad_base = 0;                              // offset of the grad arena in its segment
  std::string param_region, grad_region;
  ShmSegment& grads() { return grads_seg ? *grads_seg : *params_seg; }
  const v1::TensorLayout& tensor(size_t i) const { return layout.layout(static_cast<int>(i)); }
  std::string ParamBytes(size_t i) const;
  void WriteGrad(size_t i, const std::vector<float>& g);
  void WriteGradBytes(size_t i, const std::string& bytes);
};
// Writes SyntheticValues(seed, step t) into every gradient of `s`.
void WriteSyntheticGrads(ShmSession* s, const SessionDesc& d, uint64_t seed, int64_t t);
// CreateSession + segments + RegisterRegion for both roles (ADD_FAILUREs and returns null on
// error).
std::unique_ptr<ShmSession> CreateShmSession(v1::Optimizer::Stub& stub,
                                             const v1::CreateSessionRequest& req,
                                             bool two_segments = false);
// The segments and RegisterRegion part of CreateShmSession, for a session that exists already
// (e.g. from LoadCheckpoint).
std::unique_ptr<ShmSession> BindShmSession(v1::Optimizer::Stub& stub,
                                           const v1::CreateSessionResponse& layout,
                                           bool two_segments = false);

grpc::Status DoStep(v1::Optimizer::Stub& stub, const std::string& session, int64_t index,
                    v1::StepResponse* resp = nullptr);
// Step with StepRequest.params_without_grad.
grpc::Status DoStepWithout(v1::Optimizer::Stub& stub, const std::string& session, int64_t index,
                           const std::vector<int32_t>& params_without_grad,
                           v1::StepResponse* resp = nullptr);
grpc::Status CloseSession(v1::Optimizer::Stub& stub, const std::string& session);

}  // namespace diond::service_testing

#endif  // DIOND_TESTS_SERVICE_SERVICE_HARNESS_H_
