// Domain types of a session: what the trainer declared (parameters, groups, policies) and where
// each tensor lives (the layout). Plain structs; server/rpc converts proto messages into these
// at the edge (STYLE.md R2).
#ifndef DIOND_SERVER_SESSION_TYPES_H_
#define DIOND_SERVER_SESSION_TYPES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/optim/optimizer_types.h"
#include "kernels/tensor.h"

namespace diond::session {

using kernels::DType;

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // 0-D (scalar) allowed for AdamW/Lion groups
  DType dtype = DType::kF32;   // the trainer's storage type
  std::string group;
};

struct GroupSpec {
  std::string name;
  optim::GroupConfig config;
};

enum class NonFinitePolicy { kSkip, kError };

// How the gradients of a world session's trainers are combined (ARCHITECTURE.md §2 step 3,
// docs/DISTRIBUTED.md).
enum class GradientSync {
  kReplicated,      // the trainers already hold identical (averaged) gradients
  kAverage,         // the daemons average the trainers' local gradients (reduce-scatter to owners)
  kDionCompressed,  // Dion groups: low-rank P/R averaging (ALGORITHMS.md §9.7)
};
absl::string_view GradientSyncName(GradientSync s);  // "REPLICATED", "AVERAGE", "DION_COMPRESSED"

// A session name: 1..200 bytes of [A-Za-z0-9._-] in '/'-separated components, none of them
// empty, "." or "..". INVALID_ARGUMENT saying what is wrong otherwise.
absl::Status ValidateSessionName(absl::string_view name);

struct SessionSpec {
  std::vector<ParamSpec> params;
  std::vector<GroupSpec> groups;
  NonFinitePolicy non_finite = NonFinitePolicy::kSkip;
  // The trainer holds bf16/f16 weights; the daemon keeps fp32 master weights and writes the
  // rounded values back after each step. Without it, bf16/f16 weights are widened, updated and
  // rounded back every step.
  bool fp32_master_weights = false;
  std::string client_name;
  // A stable name the client chose (e.g. "job-17/rank-0"; ValidateSessionName), unique among the
  // daemon's live sessions: a new trainer presenting it re-attaches to the session
  // (SessionManager::Attach) and --recover restores it under it. Empty = unnamed.
  std::string session_name;
  // The principal that created the session, as an opaque string filled in by the RPC layer's
  // authentication (empty = unauthenticated). Attach compares it; nothing else interprets it.
  std::string owner;
  // The name every rank's trainer gives the same world session (docs/DISTRIBUTED.md). Empty = a
  // local session: this daemon alone, as before worlds existed.
  std::string world_key;
  GradientSync gradient_sync = GradientSync::kReplicated;
};

inline constexpr int64_t kArenaAlignment = 256;

struct TensorPlacement {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  int64_t numel = 0;
  int64_t size_bytes = 0;
  int64_t param_offset = 0;
  int64_t grad_offset = 0;
};

struct Layout {
  std::vector<TensorPlacement> tensors;  // in declaration order
  int64_t param_arena_bytes = 0;
  int64_t grad_arena_bytes = 0;
};

// One bucket of a DOORBELLS page (RegisterRegion's Bucket; docs/DATA_PLANE.md "Overlapped
// step"): its parameters' indices and, on a device session, its events' 64-byte handles (empty:
// none; every bucket has both or none).
struct DoorbellBucket {
  std::vector<int32_t> params;
  std::string ready_event, done_event;
};

struct StepRequest {
  int64_t step_index = 0;
  std::map<std::string, double> lr_override;  // group name -> lr
  double gradient_scale = 1.0;
  // Group name -> the trainer's step number for the group (StepRequest.group_step); absent
  // groups use step_index.
  std::map<std::string, int64_t> group_step;
  // StepRequest.asynchronous / .wait (docs/DATA_PLANE.md "Asynchronous Step").
  bool asynchronous = false;
  bool wait = false;
  // StepRequest.ready_event / .done_event (docs/DATA_PLANE.md "The event protocol"): the
  // trainer's interprocess CUDA event handles (64 bytes each; empty = none). A device session's
  // stream waits on ready_event before it reads the gradients and records done_event once the
  // new weights are written.
  std::string ready_event;
  std::string done_event;
  // StepRequest.params_without_grad: indices into Layout::tensors whose parameter (and state)
  // this step leaves alone. Validated by the session (range, repeats).
  std::vector<int32_t> params_without_grad;
  // StepRequest.overlap (docs/DATA_PLANE.md "Overlapped step"): the asynchronous step stages
  // each bucket as the doorbell page says its gradients are written.
  bool overlap = false;
  // How long the overlapped step waits for each bucket's doorbell: the daemon's
  // --overlap_bucket_timeout, set by SessionManager::Step (not a field of the RPC).
  absl::Duration overlap_bucket_wait = absl::Minutes(10);
  // StepRequest.max_grad_norm (grad_clip.h): 0 = no clip.
  double max_grad_norm = 0.0;
};

struct StepResult {
  int64_t step_index = 0;
  bool skipped = false;
  bool replayed = false;
  std::map<std::string, double> update_norms;
  int64_t compute_micros = 0;
  int64_t total_micros = 0;
  int64_t world_bytes_sent = 0;     // world sessions: bytes this daemon sent for this step
  int64_t checksum_mismatches = 0;  // world sessions: copies healed at this step's check
  double grad_norm = 0.0;           // max_grad_norm > 0: the gradients' norm before the clip
  bool queued = false;              // an asynchronous step: validated and queued, not run yet
  // The queued asynchronous step's result, collected by this call (at most one).
  std::vector<StepResult> previous;
  // Device sessions (docs/GPU.md "CUDA graphs"): a step runs in three phases that can each be
  // a captured graph, "read" (the uploads and scans), "update" (the rules) and "write" (the new
  // weights and the update norms). graph_steps: (phase, "captured" | "replayed") for each phase
  // that ran as a graph. graph_fallbacks: (phase, reason) on the step where a phase was found to
  // run eagerly for good: "unsupported" (the backend cannot capture), "sync_point" (an op of the
  // phase waits for the device), "capture_failed", "world" (a world session with compressed
  // Dion), "pageable" (host memory the phase copies is not pinned).
  std::vector<std::pair<std::string, std::string>> graph_steps;
  std::vector<std::pair<std::string, std::string>> graph_fallbacks;
};

// A named float32 tensor (state, parameters) as it crosses the session boundary.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// What a client stream writes: gradients (PushGradients) or parameters and state (SetState).
enum class StreamKind { kGradients, kState };

// One write into an arena or the state, from a stream chunk.
struct TensorWrite {
  std::string name;  // parameter name (its values or gradient) or "<param>/state.<name>"
  int64_t offset_bytes = 0;
  std::string data;
};

struct SessionInfo {
  std::string id;
  std::string client_name;
  std::string owner;  // SessionSpec::owner
  std::string session_name;
  int64_t parameters = 0;
  int64_t last_step_index = 0;
  int64_t state_bytes = 0;
  // What --max_session_bytes / --memory_budget_bytes count (Session::BudgetBytes): state_bytes
  // for a host session; a device session's device pool bytes plus its host-side state.
  int64_t budget_bytes = 0;
  int64_t host_bytes = 0;  // daemon-owned arenas and Step's fp32 conversion buffers
  absl::Time last_used;
  // Operator view (ListSessions, metrics).
  struct Group {
    std::string name;
    optim::AlgorithmKind algorithm = optim::AlgorithmKind::kMuon;
    int64_t parameters = 0;
  };
  std::vector<Group> groups;
  std::string world_key;
  absl::Time last_step_time = absl::InfinitePast();  // InfinitePast = no step yet
  int64_t last_checkpoint_step = 0;                  // 0 = none
  std::string last_checkpoint_path;
  absl::Time last_checkpoint_time = absl::InfinitePast();
};

// What a checkpoint holds: the spec, the step record and every tensor (fp32).
struct SessionSnapshot {
  std::string session_id;  // ReadCheckpoint: the id the checkpoint was written under
  SessionSpec spec;
  int64_t last_step_index = 0;
  // The answer of step last_step_index, so that a retried Step is replayed after a restore.
  std::optional<StepResult> last_result;
  std::vector<NamedTensor> tensors;  // "<param>" and "<param>/state.<name>"
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_TYPES_H_
