// A device session's step phases as captured graphs (docs/GPU.md "CUDA graphs"): from the second
// step, the read, update and write phases are captured once and replayed where the backend can
// capture and the host memory they copy is pinned; the others run eagerly, and say why once.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/session/session_device.h"

namespace diond::session {

std::string Session::DeviceSide::HostGraphKey(const Arenas& a) {
  // A binding's identity: its region id (new at every registration), where it is mapped, its
  // DMA registration, and a CUDA region's device memory.
  auto one = [](const Arenas::Binding& b) {
    return absl::StrCat(b.region_id, "@", reinterpret_cast<uintptr_t>(b.data), "/",
                        reinterpret_cast<uintptr_t>(b.dma.get()), "/",
                        b.cuda != nullptr ? reinterpret_cast<uintptr_t>(b.cuda->data()) : 0);
  };
  return absl::StrCat(one(a.params()), ";", one(a.grads()));
}

std::string Session::DeviceSide::UnpinnedHostMemory(const Arenas& a) const {
  if (!words_pinned) return "the session's host words are not registered for DMA";
  for (Role r : {Role::kParameters, Role::kGradients}) {
    const Arenas::Binding& b = a.binding(r);
    if (b.cuda != nullptr || b.data == nullptr || b.dma != nullptr) continue;
    return absl::StrCat(
        "the ", RoleName(r), " ",
        b.region != nullptr ? b.region->Describe() : std::string("host arena of the streamed path"),
        " is not registered for DMA (pinned)");
  }
  return "";
}

void Session::DeviceSide::DecideGraphs(Session& s, StepRun& run) {
  if (std::string key = HostGraphKey(s.arenas_); key != host_key) {
    // The regions changed since the phases that copy host memory were decided: their graphs
    // hold the old addresses. Decided again below.
    for (GraphPhase p : {GraphPhase::kRead, GraphPhase::kWrite}) {
      PhaseGraph& pg = phase(p);
      pg.graph.reset();
      pg.decided = false;
      pg.reason.clear();
      pg.reported = false;
    }
    host_key = std::move(key);
  }
  const bool capture =
      runtime.begin_capture && runtime.end_capture && runtime.launch_graph && stream != nullptr;
  const WorldPart* world = s.world_.get();
  for (GraphPhase p : {GraphPhase::kRead, GraphPhase::kUpdate, GraphPhase::kWrite}) {
    PhaseGraph& pg = phase(p);
    if (!pg.decided) {
      pg.decided = true;
      std::string reason, why;
      if (!capture) {
        reason = "unsupported";
        why = "the device backend has no stream capture (or --step_graphs=false)";
      } else if (p == GraphPhase::kUpdate && !runtime.rules_on_device) {
        reason = "unsupported";
        why = "the update rules do not run on the device context";
      } else if (p == GraphPhase::kUpdate && world != nullptr &&
                 std::find(world->replicated.begin(), world->replicated.end(), true) !=
                     world->replicated.end()) {
        reason = "world";
        why =
            "compressed Dion averages P and R with the other ranks inside its update, which a "
            "captured graph of one daemon cannot hold";
      } else if (p != GraphPhase::kUpdate) {
        why = UnpinnedHostMemory(s.arenas_);
        if (!why.empty()) reason = "pageable";
      }
      if (reason.empty()) {
        // (A world session's collectives run between the phases, outside the graphs.) The
        // phase's first Run (this step) captures, or says why it cannot.
        kernels::GraphHooks gh;
        gh.begin_capture = runtime.begin_capture;
        gh.end_capture = runtime.end_capture;
        gh.launch = runtime.launch_graph;
        gh.destroy = runtime.destroy_graph;
        kernels::StepGraph::Options o;
        // The read and write phases copy the trainer's (pinned) memory; a local session's update
        // reads its norms back into the pinned host words.
        o.host_copies = p != GraphPhase::kUpdate || world == nullptr;
        pg.graph = std::make_unique<kernels::StepGraph>(ctx.get(), std::move(gh), o);
      } else {
        DIOND_LOG(INFO) << "session " << s.id_ << ": the " << pg.name
                        << " phase of its steps runs eagerly, not as a captured graph (reason "
                        << reason << ": " << why << ")";
        pg.reason = reason;
        pg.reported = false;
      }
    }
    if (!pg.reason.empty() && !pg.reported) {
      run.result.graph_fallbacks.emplace_back(pg.name, pg.reason);
    }
  }
}

absl::Status Session::DeviceSide::RunPhaseGraph(Session& s, StepRun& run, GraphPhase which,
                                                const std::function<absl::Status()>& body,
                                                const std::function<void()>& undo) {
  PhaseGraph& pg = phase(which);
  if (pg.graph == nullptr) return body();
  absl::StatusOr<kernels::StepGraph::Outcome> out = pg.graph->Run(body);
  if (!out.ok()) {
    // The graph was chosen, and its upload or launch failed: what it queued is not trusted (the
    // caller fails the step; nothing is committed).
    return absl::Status(out.status().code(),
                        absl::StrCat(run.when, ": launching the ", pg.name,
                                     " phase's graph failed: ", out.status().message(),
                                     "; the step was not applied"));
  }
  if (out->mode != kernels::StepGraph::Mode::kEager) {
    const bool captured = out->mode == kernels::StepGraph::Mode::kCaptured;
    run.result.graph_steps.emplace_back(pg.name, captured ? "captured" : "replayed");
    if (captured) {
      DIOND_LOG(INFO) << "session " << s.id_ << ": " << run.when << ": the " << pg.name
                      << " phase was captured as a graph (" << out->ops << " ops, " << out->records
                      << " scalar records; " << pg.graph->graphs() << " graph(s) held)";
    }
    return absl::OkStatus();
  }
  if (out->reason != "phase_failed") {
    // A lasting reason: this phase runs eagerly from now on.
    DIOND_LOG(INFO) << "session " << s.id_ << ": the " << pg.name << " phase of its steps runs "
                    << "eagerly, not as a captured graph (reason " << out->reason << ": "
                    << out->detail << ")";
    pg.graph.reset();
    pg.reason = out->reason;
    pg.reported = false;
    run.result.graph_fallbacks.emplace_back(pg.name, pg.reason);
  }
  // Nothing of the phase ran (a recording or a failed capture executes nothing): undo what the
  // passes set up on the host, and run it now.
  if (undo) undo();
  return body();
}

}  // namespace diond::session
