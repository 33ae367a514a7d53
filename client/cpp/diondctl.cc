// diondctl: command-line client of a diond daemon.
//   diondctl [--target=unix:/path|host:port] [--timeout=5s] health [SERVICE]
//   diondctl [--target=...] sessions
// Exit status: 0 on success (health: SERVING), 1 when the daemon answers otherwise or cannot be
// reached, 2 on bad usage.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, target, "",
          "Daemon address: unix:PATH or HOST:PORT. Empty = $DIOND_TARGET, else "
          "unix:$XDG_RUNTIME_DIR/diond.sock (or /tmp/diond-<uid>.sock).");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "Deadline of each call.");

namespace {

std::string DefaultTarget() {
  if (const char* t = std::getenv("DIOND_TARGET"); t != nullptr && t[0] != '\0') return t;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && x[0] != '\0') {
    return absl::StrCat("unix:", x, "/diond.sock");
  }
  return absl::StrCat("unix:/tmp/diond-", getuid(), ".sock");
}

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
}

int Health(const std::shared_ptr<grpc::Channel>& channel, const std::string& target,
           const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    std::fprintf(stderr, "diondctl: %s: health check failed: %s\n", target.c_str(),
                 s.error_message().c_str());
    return 1;
  }
  std::printf("%s %s\n", target.c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int Sessions(const std::shared_ptr<grpc::Channel>& channel, const std::string& target) {
  auto stub = diond::v1::Optimizer::NewStub(channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  diond::v1::ListSessionsResponse resp;
  grpc::Status s = stub->ListSessions(&ctx, diond::v1::ListSessionsRequest(), &resp);
  if (!s.ok()) {
    std::fprintf(stderr, "diondctl: %s: %s\n", target.c_str(), s.error_message().c_str());
    return 1;
  }
  std::printf("%d session(s)\n", resp.sessions_size());
  for (const auto& info : resp.sessions()) {
    std::printf("%s client=%s parameters=%lld last_step=%lld state_bytes=%lld\n",
                info.session_id().c_str(), info.client_name().c_str(),
                static_cast<long long>(info.parameters()),
                static_cast<long long>(info.last_step_index()),
                static_cast<long long>(info.state_bytes()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "diondctl: talk to a diond daemon.\n  diondctl [--target=unix:/path] health [SERVICE]\n"
      "  diondctl [--target=unix:/path] sessions");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "diondctl: missing command (health, sessions); see --help\n");
    return 2;
  }
  std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) target = DefaultTarget();
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  std::string cmd = args[1];
  if (cmd == "health") return Health(channel, target, args.size() > 2 ? args[2] : "");
  if (cmd == "sessions") return Sessions(channel, target);
  std::fprintf(stderr, "diondctl: unknown command '%s' (health, sessions)\n", cmd.c_str());
  return 2;
}
