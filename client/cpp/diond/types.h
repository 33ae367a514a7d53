// Plain C++ types of the diond C++ client: what a trainer describes (parameters, groups,
// hyperparameters), what the daemon answers (the arena layout, step results, session info) and
// the tensor references that the streaming calls read from or write into.
//
// Choice of representation: these structs cover the common path without any protobuf in the
// caller's code. Every call of diond::client::Client also has an overload that takes and returns
// the generated messages of proto/diond/v1/optimizer.proto (namespace diond::v1) for full
// control (every hyperparameter, reserved fields added later). The two map 1:1 through the
// To*/From* functions below. Enum values equal the proto's, so a static_cast converts them.
//
// Thread-safety: plain values; no shared state.
#ifndef DIOND_CLIENT_CPP_DIOND_TYPES_H_
#define DIOND_CLIENT_CPP_DIOND_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "diond/v1/optimizer.pb.h"

namespace diond::client {

// Element type as the trainer stores it. Values equal diond.v1.DType.
enum class DType : int { kF32 = 1, kBF16 = 2, kF16 = 3 };

// Bytes per element: 4 for kF32, 2 for kBF16 and kF16.
int64_t DTypeSize(DType dtype);

// Update rule of a group. Values equal diond.v1.Algorithm.
enum class Algorithm : int {
  kMuon = 1,
  kNorMuon = 2,
  kDion = 3,
  kDion2 = 4,
  kDion3 = 5,
  kAdamW = 6,
  kLion = 7,
};

// How Dion orthonormalizes P (the reference's qr_method). Values equal diond.v1.QrMethod.
enum class QrMethod : int { kRcqr = 1, kQr = 2, kCqr = 3 };

// The hyperparameters most groups set. Unset fields take the algorithm's reference default
// (docs/ALGORITHMS.md). For the others (orthogonalizer, adjust_lr, Dion's rank, ...) use the
// proto overloads of Client.
struct Hyperparams {
  std::optional<double> lr;
  std::optional<double> mu;
  std::optional<double> beta1;
  std::optional<double> beta2;
  std::optional<double> weight_decay;
  std::optional<double> epsilon;
  std::optional<bool> nesterov;
  std::optional<bool> cautious_wd;
  // Dion only (the daemon refuses them on other algorithms): qr_method (default kRcqr),
  // cqr_warmup_steps (default 150, counted in Step step_index) and rcqr_oversample (default
  // 1.25; the proto's Hyperparameters.oversample).
  std::optional<QrMethod> qr_method;
  std::optional<int64_t> cqr_warmup_steps;
  std::optional<double> rcqr_oversample;
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  std::string group;  // name of a GroupSpec
};

struct GroupSpec {
  std::string name;
  Algorithm algorithm = Algorithm::kAdamW;
  Hyperparams hyperparams;
};

struct SessionOptions {
  std::string client_name;
  bool fp32_master_weights = false;  // when parameters are bf16/f16
  // A stable name (e.g. "job-17/rank-0") a restarted trainer re-attaches by
  // (Client::AttachSession); empty = unnamed.
  std::string session_name{};
};

// Where one parameter lives in the arenas (diond.v1.TensorLayout).
struct TensorLayout {
  std::string name;
  int64_t param_offset_bytes = 0;
  int64_t grad_offset_bytes = 0;
  int64_t size_bytes = 0;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
};

// The answer of CreateSession (or LoadCheckpoint): the session and its arena layout.
struct Layout {
  std::string session_id;
  std::vector<TensorLayout> tensors;
  int64_t param_arena_bytes = 0;
  int64_t grad_arena_bytes = 0;
  int64_t alignment_bytes = 0;
  // The data plane (docs/DATA_PLANE.md): the daemon's fd channel socket (empty = none) and
  // whether it maps REGION_KIND_MEMFD regions (MemfdArena needs both).
  std::string fd_channel_socket;
  bool memfd_regions = false;

  // The entry named `name`, or nullptr.
  const TensorLayout* Find(absl::string_view name) const;
};

// Converts and validates the daemon's answer: every tensor has a known dtype, size_bytes equals
// the product of its shape times the dtype size, both of its byte ranges lie inside their arena
// and are multiples of alignment_bytes, names are unique. The arena helper relies on this to
// hand out spans that never leave the mapping. INVALID_ARGUMENT naming the tensor otherwise.
absl::StatusOr<Layout> LayoutFromProto(const v1::CreateSessionResponse& resp);

struct StepResult {
  int64_t step_index = 0;
  bool skipped = false;                        // non-finite gradients under the skip policy
  bool replayed = false;                       // answered from the record of a retried step
  std::map<std::string, double> update_norms;  // per group
  int64_t compute_micros = 0;
  int64_t total_micros = 0;
  double grad_norm = 0;  // StepOptions::max_grad_norm > 0: the gradients' norm before the clip
  // StepOptions::asynchronous: the step was checked and queued; only step_index is set. Its
  // result comes with the next Step (previous) or WaitStep.
  bool queued = false;
  // The result of the asynchronous step queued before this call (at most one).
  std::vector<StepResult> previous;
};

struct StepOptions {
  std::map<std::string, double> lr_override;  // group -> lr for this step only
  // group -> the trainer's 1-based step number for it (Dion's cqr warm-up counts it; groups not
  // named use the step index).
  std::map<std::string, int64_t> group_step;
  double gradient_scale = 0;  // 0 = 1.0
  // Asynchronous Step (docs/DATA_PLANE.md): the daemon answers once the step is queued. The
  // session's arenas belong to the step until its result is collected (WaitStep, or the next
  // Step): the trainer must not read or write them meanwhile.
  bool asynchronous = false;
  // The parameters (indices in the session's declaration order) without a gradient in this
  // step, as torch.optim's `p.grad is None`: the step leaves them and their state unchanged.
  std::vector<int32_t> params_without_grad;
  // Global-norm gradient clip in the daemon, as torch's clip_grad_norm_ (0 = none).
  double max_grad_norm = 0;
  // The overlapped step (needs asynchronous and a DoorbellPage, diond/doorbells.h): the daemon
  // stages each bucket as its doorbell rings and writes the weights back bucket by bucket.
  bool overlap = false;
};

struct SessionInfo {
  std::string session_id;
  std::string client_name;
  std::string session_name{};
  int64_t parameters = 0;
  int64_t last_step_index = 0;
  int64_t state_bytes = 0;
  std::string owner;  // the principal that created it (uid:N, a token's principal, x509:...)
};

struct CheckpointInfo {
  std::string path;
  int64_t step_index = 0;
  int64_t bytes = 0;
};

struct LoadedCheckpoint {
  Layout layout;
  int64_t step_index = 0;
};

// The answer of AttachSession: the live session's layout and its last applied step.
struct AttachedSession {
  Layout layout;
  int64_t step_index = 0;  // the next Step is step_index + 1
};

// Read-only bytes of one named tensor, sent by PushGradients and SetState. The referenced memory
// must stay valid for the duration of the call; nothing is copied beyond one chunk at a time.
struct ConstTensorRef {
  std::string name;
  absl::Span<const uint8_t> bytes;
  std::optional<DType> dtype;  // sent with the first chunk when set

  static ConstTensorRef F32(std::string name, absl::Span<const float> values);
  static ConstTensorRef BF16(std::string name, absl::Span<const uint16_t> values);
};

// Caller-owned destination of one named tensor, filled by PullParameters/GetState. Its size must
// equal the tensor's total_bytes as the daemon reports it.
struct MutableTensorRef {
  std::string name;
  absl::Span<uint8_t> bytes;

  static MutableTensorRef F32(std::string name, absl::Span<float> values);
  static MutableTensorRef BF16(std::string name, absl::Span<uint16_t> values);
};

// A tensor received into client-owned memory (PullParameters/GetState map mode).
struct Tensor {
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  std::string bytes;

  // The values reinterpreted as fp32; empty unless dtype is kF32.
  std::vector<float> AsF32() const;
};

using TensorMap = std::map<std::string, Tensor>;

// Conversions to the proto messages.
v1::CreateSessionRequest ToProto(const std::vector<ParamSpec>& params,
                                 const std::vector<GroupSpec>& groups,
                                 const SessionOptions& options);
v1::Hyperparameters ToProto(const Hyperparams& hp);
StepResult FromProto(const v1::StepResponse& resp);

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_TYPES_H_
