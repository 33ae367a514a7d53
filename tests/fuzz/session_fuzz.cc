// libFuzzer target (main-build mode only, -DDIOND_BUILD_FUZZERS=ON): a live session driven by a
// sequence of requests, each decoded from protobuf wire bytes and handled by the functions the
// Optimizer service calls (server/rpc/convert.cc, server/rpc/chunk_collector.cc, then the
// SessionManager and the Session):
//   Step (StepRequestFromProto), PushGradients and SetState streams (ChunkCollector, then
//   ApplyGradientWrites / ApplyStateWrites), RegisterRegion (RegionRoleFromProto, then
//   RegisterShmRegion on the harness's own POSIX shm segment), UnregisterRegion,
//   SetHyperparameters (HyperparameterChangeFromProto), SaveCheckpoint and LoadCheckpoint
//   (relative paths under a state dir, as a non-admin peer may name), and the trainer shrinking
//   or growing its segment (ftruncate) between requests.
// Properties, besides no crash and no sanitizer report:
//  - a refused request changes nothing: the session's parameters and state (GetState) and its
//    step index are bit for bit what they were; so does an accepted SetHyperparameters,
//    SaveCheckpoint or LoadCheckpoint (into another session);
//  - an accepted Step is the one asked for (its index becomes the session's);
//  - a saved checkpoint lies under the state dir;
//  - every error message is bounded and one line.
// Input: records of one byte (the request: see `switch` below), two bytes of length
// (little-endian) and that many bytes of payload; a stream's payload is itself such records of
// TensorChunk messages. The session id "s" in a request stands for the live session's id, the
// segment name "seg" for the harness's segment (other names are only validated, never opened:
// the fuzzer must not map other processes' memory).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/logging.h"
#include "diond/v1/optimizer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/checkpoint/directory_store.h"
#include "server/memory/shm_region.h"
#include "server/rpc/chunk_collector.h"
#include "server/rpc/convert.h"
#include "server/session/session_manager.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::session::NamedTensor;

std::string g_state_dir;
std::string g_segment;  // the harness's POSIX shm segment (name without '/')
int g_segment_fd = -1;

using diond::fuzz::Records;
using diond::fuzz::Require;

void RequireBounded(const absl::Status& s) { diond::fuzz::RequireBoundedMessage(s, 2048); }

// The session every input starts with: a Muon group of one bf16 matrix and an AdamW group of
// one f32 vector, as the service tests create (tests/service).
diond::v1::CreateSessionRequest SessionRequest() {
  diond::v1::CreateSessionRequest req;
  req.set_client_name("session_fuzz");
  auto* m = req.add_groups();
  m->set_name("m");
  m->set_algorithm(diond::v1::ALGORITHM_MUON);
  auto* v = req.add_groups();
  v->set_name("v");
  v->set_algorithm(diond::v1::ALGORITHM_ADAMW);
  auto* w = req.add_parameters();
  w->set_name("w");
  w->set_group("m");
  w->set_dtype(diond::v1::DTYPE_BF16);
  w->add_shape(4);
  w->add_shape(4);
  auto* b = req.add_parameters();
  b->set_name("b");
  b->set_group("v");
  b->set_dtype(diond::v1::DTYPE_F32);
  b->add_shape(4);
  return req;
}

struct Observed {
  absl::StatusOr<std::vector<NamedTensor>> state = std::vector<NamedTensor>{};
  int64_t step = 0;
};

Observed Observe(diond::session::Session& s) {
  return Observed{s.GetState(/*include_parameters=*/true), s.last_step_index()};
}

bool SameState(const Observed& a, const Observed& b) {
  if (a.step != b.step) return false;
  if (!a.state.ok() || !b.state.ok()) return a.state.ok() == b.state.ok();
  if (a.state->size() != b.state->size()) return false;
  for (size_t i = 0; i < a.state->size(); ++i) {
    const NamedTensor& x = (*a.state)[i];
    const NamedTensor& y = (*b.state)[i];
    if (x.name != y.name || x.shape != y.shape || x.data.size() != y.data.size() ||
        std::memcmp(x.data.data(), y.data.data(), x.data.size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  diond::fuzz::QuietLogs();
  char tmpl[] = "/tmp/diond-session-fuzz.XXXXXX";
  Require(mkdtemp(tmpl) != nullptr, "mkdtemp");
  g_state_dir = tmpl;
  g_segment = "diond-session-fuzz-" + std::to_string(getpid());
  g_segment_fd = shm_open(("/" + g_segment).c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  Require(g_segment_fd >= 0, "shm_open");
  static std::string dir = g_state_dir, seg = g_segment;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    shm_unlink(("/" + seg).c_str());
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A fresh state dir content, a 64 KiB segment (more than both arenas) and a fresh manager.
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(g_state_dir, ec)) {
    std::filesystem::remove_all(e.path(), ec);
  }
  Require(ftruncate(g_segment_fd, 0) == 0 && ftruncate(g_segment_fd, 65536) == 0, "ftruncate");
  diond::session::ManagerOptions options;
  options.state_dir = g_state_dir;
  options.checkpoints = std::make_shared<diond::checkpoint::DirectoryStore>(g_state_dir);
  options.compute_threads = 1;
  auto manager = diond::session::SessionManager::Create(options);
  Require(manager.ok(), "SessionManager::Create");
  auto spec = diond::rpc::SpecFromProto(SessionRequest());
  Require(spec.ok(), "the harness's session spec");
  spec->owner = "uid:1000";
  auto created = (*manager)->CreateSession(*std::move(spec));
  Require(created.ok(), "CreateSession");
  std::shared_ptr<diond::session::Session> session = *created;
  const std::string id = session->id();
  auto ids = [&id](const std::string& s) { return s == "s" ? id : s; };

  Records records(reinterpret_cast<const char*>(data), size);
  int kind = 0;
  std::string bytes;
  for (int op = 0; op < 48 && records.Next(&kind, &bytes); ++op) {
    const Observed before = Observe(*session);
    absl::Status status;
    switch (kind % 9) {
      case 0: {  // Step
        diond::v1::StepRequest req;
        if (!req.ParseFromString(bytes)) continue;
        auto r = (*manager)->Step(ids(req.session_id()), diond::rpc::StepRequestFromProto(req));
        status = r.status();
        if (r.ok() && ids(req.session_id()) == id) {
          if (req.wait() && req.step_index() == 0) {
            // A Step with wait and no index collects whatever step is queued, or replays the
            // recorded last one (docs/DATA_PLANE.md "Asynchronous Step"): its own index.
            Require(r->step_index == session->last_step_index(),
                    "Step with wait answered another step than the recorded one");
          } else {
            Require(r->step_index == req.step_index(), "Step answered another index");
            Require(session->last_step_index() == req.step_index(), "step index not recorded");
          }
        }
        break;
      }
      case 1:    // PushGradients
      case 2: {  // SetState
        const auto stream = kind % 9 == 1 ? diond::session::StreamKind::kGradients
                                          : diond::session::StreamKind::kState;
        diond::rpc::ChunkCollector collector(manager->get(), stream, /*max_chunk_bytes=*/256,
                                             /*max_stream_bytes=*/4096,
                                             [](const std::string&) { return absl::OkStatus(); });
        Records chunks(bytes.data(), bytes.size());
        int ignored = 0;
        std::string chunk_bytes;
        while (status.ok() && chunks.Next(&ignored, &chunk_bytes)) {
          diond::v1::TensorChunk chunk;
          if (!chunk.ParseFromString(chunk_bytes)) continue;
          chunk.set_session_id(ids(chunk.session_id()));
          status = collector.Add(&chunk);
        }
        Require(collector.bytes() <= 4096, "a stream buffered more than --max_stream_bytes");
        if (status.ok() && collector.chunks() > 0) {
          auto s = (*manager)->Get(collector.session());
          status = s.status();
          if (s.ok()) {
            status = stream == diond::session::StreamKind::kGradients
                         ? (*s)->ApplyGradientWrites(collector.TakeWrites())
                         : (*s)->ApplyStateWrites(collector.TakeWrites());
          }
        }
        break;
      }
      case 3: {  // RegisterRegion
        diond::v1::RegisterRegionRequest req;
        if (!req.ParseFromString(bytes)) continue;
        auto s = (*manager)->Get(ids(req.session_id()));
        status = s.status();
        if (!s.ok()) break;
        auto role = diond::rpc::RegionRoleFromProto(req);
        status = role.status();
        if (!role.ok()) break;
        // MEMFD and the CUDA kinds take the fd channel / device paths of the service, which this
        // target does not drive.
        if (req.kind() != diond::v1::REGION_KIND_SYSTEM_SHM) continue;
        const std::string& name = req.system_shm().name();
        if (name != "seg") {
          status = diond::memory::ValidateShmName(name);
          if (status.ok()) continue;  // a valid name of somebody else's segment: not opened
          break;
        }
        auto region = (*s)->RegisterShmRegion(*role, g_segment, req.system_shm().offset_bytes(),
                                              req.system_shm().size_bytes());
        status = region.status();
        break;
      }
      case 4: {  // UnregisterRegion
        diond::v1::UnregisterRegionRequest req;
        if (!req.ParseFromString(bytes)) continue;
        auto s = (*manager)->Get(ids(req.session_id()));
        status = s.ok() ? (*s)->UnregisterRegion(req.region_id()) : s.status();
        break;
      }
      case 5: {  // SetHyperparameters
        diond::v1::SetHyperparametersRequest req;
        if (!req.ParseFromString(bytes)) continue;
        auto s = (*manager)->Get(ids(req.session_id()));
        status = s.status();
        if (!s.ok()) break;
        auto change = diond::rpc::HyperparameterChangeFromProto(req);
        status = change.ok() ? (*s)->SetGroupHyperparameters(change->group, change->lr,
                                                             change->weight_decay)
                             : change.status();
        // An accepted change alters future steps, not the state: compared below like a refusal.
        break;
      }
      case 6: {  // SaveCheckpoint (relative directory, as CheckPathAllowed lets a peer name)
        diond::v1::SaveCheckpointRequest req;
        if (!req.ParseFromString(bytes)) continue;
        const std::string& dir = req.directory();
        if (!dir.empty() && (dir[0] == '/' || dir.find("..") != std::string::npos)) continue;
        auto saved = (*manager)->SaveCheckpoint(ids(req.session_id()), dir);
        status = saved.status();
        if (saved.ok()) {
          Require(saved->first.compare(0, g_state_dir.size() + 1, g_state_dir + "/") == 0,
                  "a checkpoint was written outside the state dir");
        }
        break;
      }
      case 7: {  // LoadCheckpoint (relative paths only)
        diond::v1::LoadCheckpointRequest req;
        if (!req.ParseFromString(bytes)) continue;
        bool relative = !req.path().empty();
        for (const std::string& p : req.shard_paths()) relative &= !p.empty() && p[0] != '/';
        if (!relative || req.path()[0] == '/' || req.path().find("..") != std::string::npos ||
            req.shard_paths_size() > 8) {
          continue;
        }
        std::vector<std::string> shards(req.shard_paths().begin(), req.shard_paths().end());
        auto loaded = (*manager)->LoadCheckpoint(req.path(), shards,
                                                 diond::session::Caller{"uid:1000", false});
        status = loaded.status();
        if (loaded.ok() && (*loaded)->id() != id) {
          (void)(*manager)->Close((*loaded)->id());  // keep one session
        }
        break;
      }
      default: {  // the trainer resizes its segment
        if (bytes.size() < 2) continue;
        const off_t bytes_now =
            (static_cast<unsigned char>(bytes[0]) | (static_cast<unsigned char>(bytes[1]) << 8)) *
            4;
        Require(ftruncate(g_segment_fd, bytes_now) == 0, "ftruncate");
        continue;  // not a request: the trainer changed its own memory
      }
    }
    if (!status.ok()) {
      RequireBounded(status);
      Require(SameState(before, Observe(*session)), "a refused request changed the session");
    } else if (kind % 9 == 5 || kind % 9 == 6 || kind % 9 == 7) {
      Require(SameState(before, Observe(*session)),
              "a request that does not write the state changed it");
    }
  }
  return 0;
}
