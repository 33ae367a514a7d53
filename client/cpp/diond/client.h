// diond C++ client: a typed wrapper of every RPC of diond.v1.Optimizer plus the standard health
// check, for trainers written in C++.
//
//   auto client = diond::client::Client::Connect("unix:/run/user/1000/diond.sock");
//   auto layout = (*client)->CreateSession(params, groups);
//   auto arena = diond::client::ShmArena::Create(client->get(), *layout);   // shm_arena.h
//   ... backward writes into arena->Grad("w1") ...
//   auto step = (*client)->Step(layout->session_id, 1);   // weights updated in arena->Param(...)
//
// Errors: every call returns absl::Status / absl::StatusOr. A failed RPC comes back with the
// daemon's code and message unchanged (FromGrpcStatus: grpc::StatusCode and absl::StatusCode
// both follow google.rpc.Code, so the mapping is 1:1). Client-side checks (bad chunk size,
// incomplete stream, a buffer of the wrong size) return INVALID_ARGUMENT or DATA_LOSS.
//
// Types: each call exists twice. The plain overload uses the structs of diond/types.h; the proto
// overload takes and returns the generated diond::v1 messages for full control. Streaming calls
// take named byte spans (ConstTensorRef / MutableTensorRef) and chunk or reassemble them.
//
// Deadlines: unary calls get ClientOptions::deadline, streaming calls ::stream_deadline.
//
// Thread-safety: a Client is safe to use from many threads at once (gRPC stubs are), and is
// neither copyable nor movable; share it through the unique_ptr Connect returns.
#ifndef DIOND_CLIENT_CPP_DIOND_CLIENT_H_
#define DIOND_CLIENT_CPP_DIOND_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "diond/types.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "diond/v1/optimizer.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/status.h"

namespace diond::client {

// TLS towards a daemon started with --tls_cert/--tls_key (docs/OPERATIONS.md "Security").
struct TlsOptions {
  bool enabled = false;
  std::string ca_pem;       // CA of the daemon's certificate; empty = the system roots
  std::string cert_pem;     // this client's certificate chain, for mutual TLS (--tls_client_ca)
  std::string key_pem;      // its private key
  std::string server_name;  // name to verify the daemon's certificate against; empty = target host
};

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(30);         // each unary call
  absl::Duration stream_deadline = absl::Minutes(10);  // each streaming call
  // Connect() waits this long for the channel to connect; zero = don't wait (the first call
  // connects, and fails with UNAVAILABLE if the daemon is not there).
  absl::Duration connect_timeout = absl::Seconds(10);
  // Data bytes per TensorChunk sent by PushGradients/SetState, and asked of PullParameters;
  // in [1, 4 MiB].
  int64_t chunk_bytes = int64_t{4} << 20;
  // Bearer token (the daemon's --auth_token_file), sent as "authorization: Bearer <token>" on
  // every call over TCP; never on a Unix socket, where the caller's uid is its identity.
  std::string token;
  TlsOptions tls;
};

// Serving status of grpc.health.v1.Health/Check.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

class Client {
 public:
  // `target` is "unix:/path/to.sock" or "host:port" (plaintext unless options.tls.enabled).
  // INVALID_ARGUMENT for an empty target or a bad option; UNAVAILABLE if the channel does not
  // connect within options.connect_timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ClientOptions& options = {});
  // Uses an existing channel (e.g. one with TLS credentials). Does not wait for it to connect.
  // The channel must accept messages of chunk_bytes plus framing (Connect sets 16 MiB; gRPC's
  // default of 4 MiB is too small for 4 MiB chunks: lower options.chunk_bytes then).
  static absl::StatusOr<std::unique_ptr<Client>> FromChannel(std::shared_ptr<grpc::Channel> channel,
                                                             const ClientOptions& options = {});

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return options_; }

  // grpc.health.v1.Health/Check of `service` ("" = the whole daemon, "diond.v1.Optimizer").
  absl::StatusOr<ServingStatus> Health(const std::string& service = "") const;

  // ---- sessions -------------------------------------------------------------------------------
  // Creates a session; returns its id and the arena layout, validated by LayoutFromProto.
  absl::StatusOr<Layout> CreateSession(const std::vector<ParamSpec>& params,
                                       const std::vector<GroupSpec>& groups,
                                       const SessionOptions& options = {}) const;
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(
      const v1::CreateSessionRequest& request) const;

  // Re-attaches a restarted trainer to the live session named `session_name` (created with
  // SessionOptions::session_name): the previous trainer's regions are dropped and the layout and
  // last step index come back. Create a ShmArena for the layout (shm_arena.h): registering its
  // PARAMETERS region delivers the daemon's current weights into it; then continue with
  // Step(step_index + 1). NOT_FOUND if no live session has the name.
  absl::StatusOr<AttachedSession> AttachSession(const std::string& session_name) const;
  absl::StatusOr<v1::AttachSessionResponse> AttachSession(
      const v1::AttachSessionRequest& request) const;

  absl::Status CloseSession(const std::string& session_id) const;
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(
      const v1::CloseSessionRequest& request) const;

  absl::StatusOr<std::vector<SessionInfo>> ListSessions() const;
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(
      const v1::ListSessionsRequest& request) const;

  // The daemon's option table: every field of v1::Hyperparameters with its type, range and
  // algorithms, and every algorithm's defaults (unset fields take them in CreateSession).
  absl::StatusOr<v1::DescribeOptionsResponse> DescribeOptions() const;

  // ---- regions (see shm_arena.h for the helper that creates and registers them) -------------
  // Registers a POSIX shm segment `shm_name` (no leading '/', [A-Za-z0-9._-]{1,200}) whose bytes
  // [offset_bytes, offset_bytes + size_bytes) hold the arena of `role`. Returns the region id.
  absl::StatusOr<std::string> RegisterShmRegion(const std::string& session_id, v1::RegionRole role,
                                                const std::string& shm_name, int64_t offset_bytes,
                                                int64_t size_bytes) const;
  absl::StatusOr<v1::RegisterRegionResponse> RegisterRegion(
      const v1::RegisterRegionRequest& request) const;
  // A sealed memfd sent over the fd channel first (SendFdToChannel in memfd_arena.h returns the
  // token). Returns the region id.
  absl::StatusOr<std::string> RegisterMemfdRegion(const std::string& session_id,
                                                  v1::RegionRole role, const std::string& fd_token,
                                                  int64_t offset_bytes, int64_t size_bytes) const;

  absl::Status UnregisterRegion(const std::string& session_id, const std::string& region_id) const;
  absl::StatusOr<v1::UnregisterRegionResponse> UnregisterRegion(
      const v1::UnregisterRegionRequest& request) const;

  // ---- steps and hyperparameters -------------------------------------------------------------
  // Applies step `step_index` (last+1), or replays the recorded answer of `last`.
  absl::StatusOr<StepResult> Step(const std::string& session_id, int64_t step_index,
                                  const StepOptions& options = {}) const;
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request) const;
  // Waits for the session's queued asynchronous step and returns its result (its error, with
  // the step index, if it failed). `step_index`: 0 or the queued step's. With nothing queued:
  // the recorded last answer (replayed).
  absl::StatusOr<StepResult> WaitStep(const std::string& session_id, int64_t step_index = 0) const;

  // Changes only the set fields of `group`'s hyperparameters.
  absl::Status SetHyperparameters(const std::string& session_id, const std::string& group,
                                  const Hyperparams& hyperparams) const;
  absl::StatusOr<v1::SetHyperparametersResponse> SetHyperparameters(
      const v1::SetHyperparametersRequest& request) const;

  // ---- remote data plane (streams of chunks of at most options().chunk_bytes) -----------------
  // Uploads each named gradient, complete. The daemon applies all or nothing.
  absl::StatusOr<v1::PushGradientsResponse> PushGradients(
      const std::string& session_id, const std::vector<ConstTensorRef>& gradients) const;

  // Downloads parameter values into caller buffers (each exactly the tensor's size). On error
  // the buffers may hold part of the data.
  absl::Status PullParameters(const std::string& session_id,
                              const std::vector<MutableTensorRef>& destinations) const;
  // Downloads the named parameters (empty = all) into a map.
  absl::StatusOr<TensorMap> PullParameters(const std::string& session_id,
                                           const std::vector<std::string>& names = {}) const;
  absl::StatusOr<TensorMap> PullParameters(const v1::PullParametersRequest& request) const;

  // Optimizer state as named tensors "<param>/state.<name>", plus "<param>" for the values when
  // include_parameters.
  absl::StatusOr<TensorMap> GetState(const std::string& session_id,
                                     bool include_parameters = false) const;
  absl::StatusOr<TensorMap> GetState(const v1::GetStateRequest& request) const;

  // Uploads state tensors (and parameter values under the parameters' own names). Returns the
  // daemon's count of tensors set.
  absl::StatusOr<int64_t> SetState(const std::string& session_id,
                                   const std::vector<ConstTensorRef>& tensors) const;
  // The same for a map as GetState returns it (a separate name: a braced list of
  // ConstTensorRefs would be ambiguous between the two).
  absl::StatusOr<int64_t> SetStateFromMap(const std::string& session_id,
                                          const TensorMap& tensors) const;

  // ---- checkpoints ----------------------------------------------------------------------------
  // `directory` is under the daemon's --state_dir; empty = its default.
  absl::StatusOr<CheckpointInfo> SaveCheckpoint(const std::string& session_id,
                                                const std::string& directory = "") const;
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& request) const;

  // Restores a session; its new layout comes back (register regions again to use it).
  absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& path) const;
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(
      const v1::LoadCheckpointRequest& request) const;

 private:
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  ClientOptions options_;
};

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_CLIENT_H_
