// StepGraph: a phase of ops (a device step's reads, update or write-back) captured once as a device
// graph and replayed, with its scalars in device memory (docs/GPU.md "CUDA graphs").
//
// How it works. Run(phase) first runs `phase` in a RECORDING pass: the context's ops go through a
// recording table (Context::InterposeBackend) that validates nothing more and executes nothing; it
// notes each op and its arguments (views: address, device, layout; scalars by value) in the
// phase's signature, and the fused steps' per-call scalars (ops.h "graph") in a host block of
// records. Then:
//   * a graph whose signature equals this one is REPLAYED: the records are queued for upload into
//     its device block (a stream-ordered copy) and the graph is launched;
//   * else a new graph is CAPTURED: `phase` runs again under the backend's stream capture, each
//     fused step given the address of its record in a new device block (ops.h
//     `scalars_on_device`), the capture is ended and instantiated, then launched as above. The
//     capture pass must issue the same ops as the recording (else the graph is dropped).
// The graphs are kept by signature (at most `capacity`, the least recently used dropped), so a
// phase that alternates between a few forms (ping-pong buffers) replays each.
//
// What cannot be in a graph makes Run return kEager, and the caller runs the phase eagerly: an op
// that hands a value to the host or reads host memory (a sync point, docs/GPU.md "Sync points")
// in the phase, a backend without stream capture, or a phase that fails. Nothing of the phase
// has run then (a recording executes nothing; a failed capture executes nothing).
//
// Host memory (Options::host_copies). By default the queued host <-> device copies
// (copy_from_host_async, copy_to_host_async) refuse a graph, like the other sync points. With
// host_copies they are captured: the graph's copy reads (or writes) the same host address at every
// replay, which is what a step over the trainer's arenas wants. The caller then promises that the
// host memory is pinned (a device cannot capture a copy of pageable memory: CUDA stages it
// synchronously, and refuses it under capture, as the TEST backend does), that it stays mapped
// at that address while the graph is held, and that it calls Clear() when it does not (a region
// unregistered or replaced). The host address and the byte count are part of the signature.
//
// The phase must be re-runnable: its host-side effects must be the same each time it runs
// (GroupOptimizer::Stage resets what it staged). The context must have a stream and must not be
// used by another thread during Run. Not thread-safe.
#ifndef DIOND_KERNELS_GRAPH_H_
#define DIOND_KERNELS_GRAPH_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"

namespace diond::kernels {

// A device's stream capture (the plugin's graph_* entries).
struct GraphHooks {
  std::function<absl::Status(Device, StreamHandle)> begin_capture;
  std::function<absl::StatusOr<void*>(Device, StreamHandle)> end_capture;  // executable graph
  std::function<absl::Status(Device, StreamHandle, void*)> launch;
  std::function<void(Device, void*)> destroy;
};

class StepGraph {
 public:
  enum class Mode { kCaptured, kReplayed, kEager };
  struct Outcome {
    Mode mode = Mode::kEager;
    // kEager: why, as a metric label: "sync_point" (an op of the phase waits for the device or
    // reads host memory), "unsupported" (the backend cannot capture), "capture_failed",
    // "phase_failed" (the recording pass returned an error: the eager run will report it).
    std::string reason;
    std::string detail;   // a sentence for the log
    int64_t ops = 0;      // ops of the phase
    int64_t records = 0;  // scalar records (fused steps) uploaded for the launch
  };

  struct Options {
    size_t capacity = 4;       // graphs kept (at least 1)
    bool host_copies = false;  // see "Host memory" above
  };
  StepGraph(Context* ctx, GraphHooks hooks, Options options);
  StepGraph(Context* ctx, GraphHooks hooks) : StepGraph(ctx, std::move(hooks), Options{}) {}
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // See above. An error only when launching or uploading failed after the graph was chosen (the
  // phase's work may then be partly queued: the caller treats it as a failed device step).
  absl::StatusOr<Outcome> Run(const std::function<absl::Status()>& phase);

  // Drops every graph held (the next Run captures again).
  void Clear();

  // Graphs held, and counts since construction.
  size_t graphs() const { return graphs_.size(); }
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }

 private:
  struct Graph;
  Context* ctx_;
  GraphHooks hooks_;
  size_t capacity_;
  bool host_copies_;
  std::list<std::unique_ptr<Graph>> graphs_;  // most recently used first
  int64_t captures_ = 0, replays_ = 0;
};

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_GRAPH_H_
