// libFuzzer target: a checkpoint directory made from arbitrary bytes, read back by
// ReadCheckpoint (server/checkpoint/read.cc), the function LoadCheckpoint and --recover use.
// The input is the text of manifest.json, optionally followed by the line "#tensors" and the
// bytes of tensors.safetensors. Properties, besides no crash and no sanitizer report:
//  - a refused checkpoint is DATA_LOSS with a bounded, one-line message;
//  - an accepted one is within the schema's ranges (step index, shapes matching the data), and
//    written again by WriteCheckpoint and read back it is the same snapshot: the same spec (as
//    JSON), step, last step record and tensors, bit for bit.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/logging.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/sandbox.h"
#include "server/checkpoint/store.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::session::SessionSnapshot;

std::string g_dir;   // the checkpoint directory the input is written into
std::string g_root;  // where the accepted snapshot is written again

using diond::fuzz::Require;

// A path (under /tmp, short) plus bounded echoes of the manifest's values.
void RequireBounded(const absl::Status& s) { diond::fuzz::RequireBoundedMessage(s, 2048); }

void WriteFile(const std::string& path, const char* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data, static_cast<std::streamsize>(size));
  Require(f.good(), "cannot write the fuzz input to /tmp");
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void RequireSame(const SessionSnapshot& a, const SessionSnapshot& b) {
  Require(diond::checkpoint::SpecToJson(a.spec) == diond::checkpoint::SpecToJson(b.spec),
          "spec changed through a save and a load");
  Require(a.last_step_index == b.last_step_index, "step index changed");
  Require(a.last_result.has_value() == b.last_result.has_value(), "last step record changed");
  if (a.last_result.has_value()) {
    const auto& x = *a.last_result;
    const auto& y = *b.last_result;
    Require(x.step_index == y.step_index && x.skipped == y.skipped &&
                x.compute_micros == y.compute_micros && x.total_micros == y.total_micros &&
                x.world_bytes_sent == y.world_bytes_sent &&
                x.checksum_mismatches == y.checksum_mismatches &&
                x.update_norms.size() == y.update_norms.size(),
            "last step record changed");
    for (const auto& [g, n] : x.update_norms) {
      auto it = y.update_norms.find(g);
      Require(it != y.update_norms.end() &&
                  (SameBits(n, it->second) || (std::isnan(n) && std::isnan(it->second))),
              "update norm changed");
    }
  }
  Require(a.tensors.size() == b.tensors.size(), "tensor count changed");
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    Require(a.tensors[i].name == b.tensors[i].name && a.tensors[i].shape == b.tensors[i].shape,
            "tensor name or shape changed");
    Require(a.tensors[i].data.size() == b.tensors[i].data.size() &&
                std::memcmp(a.tensors[i].data.data(), b.tensors[i].data.data(),
                            a.tensors[i].data.size() * 4) == 0,
            "tensor data changed");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  diond::SetMinLogLevel(diond::LogLevel::kError);
  char tmpl[] = "/tmp/diond-manifest-fuzz.XXXXXX";
  Require(mkdtemp(tmpl) != nullptr, "mkdtemp");
  g_dir = std::string(tmpl) + "/in";
  g_root = std::string(tmpl) + "/out";
  Require(mkdir(g_dir.c_str(), 0700) == 0 && mkdir(g_root.c_str(), 0700) == 0, "mkdir");
  static std::string top = tmpl;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(top, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const std::string mark = "\n#tensors\n";
  const size_t cut = input.find(mark);
  const std::string manifest = input.substr(0, cut);
  const std::string tensors = cut == std::string::npos ? "" : input.substr(cut + mark.size());
  WriteFile(g_dir + "/manifest.json", manifest.data(), manifest.size());
  WriteFile(g_dir + "/tensors.safetensors", tensors.data(), tensors.size());

  auto snap = diond::checkpoint::ReadCheckpoint(g_dir);
  if (std::getenv("DIOND_FUZZ_VERBOSE") != nullptr) {  // to see why a seed is refused
    std::fprintf(stderr, "ReadCheckpoint: %s\n", snap.status().ToString().c_str());
  }
  if (!snap.ok()) {
    Require(absl::IsDataLoss(snap.status()), "a bad checkpoint is not DATA_LOSS");
    RequireBounded(snap.status());
    return 0;
  }
  Require(snap->last_step_index >= 0 &&
              snap->last_step_index <= diond::checkpoint::kMaxCheckpointStepIndex,
          "step index out of range");
  for (const auto& t : snap->tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      Require(d >= 0, "negative dimension");
      n *= d;
    }
    Require(static_cast<int64_t>(t.data.size()) == n, "tensor data does not match its shape");
  }
  // The spec alone round-trips through its JSON form.
  auto spec = diond::checkpoint::SpecFromJson(diond::checkpoint::SpecToJson(snap->spec));
  Require(spec.ok(), "an accepted spec is refused once written again");

  // Written again and read back: the same snapshot.
  auto root = diond::checkpoint::OpenCheckpointDir("", g_root, /*create=*/false);
  Require(root.ok(), "cannot open the output directory");
  auto written = diond::checkpoint::WriteCheckpoint(*root, snap->session_id, *snap);
  Require(written.ok(), "an accepted checkpoint cannot be written again");
  auto again = diond::checkpoint::ReadCheckpoint(written->first);
  Require(again.ok(), "a checkpoint written by WriteCheckpoint is refused");
  RequireSame(*snap, *again);
  std::error_code ec;
  std::filesystem::remove_all(g_root + "/" + snap->session_id, ec);
  Require(!ec, "cannot clean up");
  return 0;
}
