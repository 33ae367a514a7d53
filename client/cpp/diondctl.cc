// diondctl: the operator's command-line client of a diond daemon (docs/OPERATIONS.md "diondctl").
//   diondctl [flags] health [SERVICE]       grpc.health.v1 status (exit 0 only when SERVING)
//   diondctl [flags] sessions               table of the daemon's sessions
//   diondctl [flags] session inspect ID     every field of one session, its groups
//   diondctl [flags] checkpoint ID          SaveCheckpoint (--dir, default --state_dir)
//   diondctl [flags] close ID               CloseSession
//   diondctl [flags] world                  membership, generation, lost ranks (ask rank 0;
//                                           exit 1 while a rank is lost)
//   diondctl [flags] top                    live steps/s, latency, errors from /metrics
// --json prints JSON instead of text on every command (top: one object per refresh and line).
// Exit status: 0 on success, 1 when the daemon refuses or cannot be reached, 2 on bad usage.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/diondctl_top.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "diond/v1/peer.grpc.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, target, "",
          "Daemon address: unix:PATH or HOST:PORT. Empty = $DIOND_TARGET, else "
          "unix:$XDG_RUNTIME_DIR/diond.sock (or /tmp/diond-<uid>.sock).");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "Deadline of each call.");
ABSL_FLAG(bool, json, false, "Print JSON instead of text (every command).");
ABSL_FLAG(std::string, token_file, "",
          "File holding a bearer token, sent as `authorization: Bearer <token>` on every call "
          "(the daemon's --auth_token_file credential). Empty = $DIOND_TOKEN_FILE, else none.");
ABSL_FLAG(std::string, world_secret_file, "",
          "world: file holding the world's shared secret (the daemons' --world_secret_file), "
          "which the Peer service requires. Empty = $DIOND_WORLD_SECRET_FILE, else none.");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle to verify the daemon's TLS certificate; setting any --tls_* flag makes "
          "the connection TLS (TCP targets).");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate for mTLS (with --tls_key_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, dir, "",
          "checkpoint: directory to write under (relative = under the daemon's --state_dir); "
          "empty = --state_dir.");
ABSL_FLAG(std::string, metrics_url, "http://127.0.0.1:9464/metrics",
          "top: the daemon's Prometheus endpoint (its --metrics_address).");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(2), "top: time between refreshes.");
ABSL_FLAG(int, iterations, 0, "top: refreshes before exiting; 0 = until interrupted.");

namespace {

using diond::v1::SessionInfo;

// ---- connection ------------------------------------------------------------------------------

std::string DefaultTarget() {
  if (const char* t = std::getenv("DIOND_TARGET"); t != nullptr && t[0] != '\0') return t;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && x[0] != '\0') {
    return absl::StrCat("unix:", x, "/diond.sock");
  }
  return absl::StrCat("unix:/tmp/diond-", getuid(), ".sock");
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

struct Connection {
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::string token;         // empty = none
  std::string world_secret;  // empty = none; sent on Peer calls only
};

// Prints the error and returns false when a credential file cannot be read.
bool Connect(Connection* c) {
  c->target = absl::GetFlag(FLAGS_target);
  if (c->target.empty()) c->target = DefaultTarget();
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty()) {
    if (const char* t = std::getenv("DIOND_TOKEN_FILE"); t != nullptr) token_file = t;
  }
  if (!token_file.empty()) {
    if (!ReadFile(token_file, &c->token)) {
      std::fprintf(stderr, "diondctl: cannot read --token_file %s\n", token_file.c_str());
      return false;
    }
    c->token = std::string(absl::StripAsciiWhitespace(c->token));
  }
  std::string secret_file = absl::GetFlag(FLAGS_world_secret_file);
  if (secret_file.empty()) {
    if (const char* t = std::getenv("DIOND_WORLD_SECRET_FILE"); t != nullptr) secret_file = t;
  }
  if (!secret_file.empty()) {
    if (!ReadFile(secret_file, &c->world_secret)) {
      std::fprintf(stderr, "diondctl: cannot read --world_secret_file %s\n", secret_file.c_str());
      return false;
    }
    c->world_secret = std::string(absl::StripAsciiWhitespace(c->world_secret));
  }
  const std::string ca = absl::GetFlag(FLAGS_tls_ca_file);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key = absl::GetFlag(FLAGS_tls_key_file);
  if (ca.empty() && cert.empty() && key.empty()) {
    c->channel = grpc::CreateChannel(c->target, grpc::InsecureChannelCredentials());
    return true;
  }
  if (cert.empty() != key.empty()) {
    std::fprintf(stderr, "diondctl: --tls_cert_file and --tls_key_file go together\n");
    return false;
  }
  grpc::SslCredentialsOptions ssl;
  for (auto [flag, path, out] : {std::make_tuple("--tls_ca_file", ca, &ssl.pem_root_certs),
                                 std::make_tuple("--tls_cert_file", cert, &ssl.pem_cert_chain),
                                 std::make_tuple("--tls_key_file", key, &ssl.pem_private_key)}) {
    if (!path.empty() && !ReadFile(path, out)) {
      std::fprintf(stderr, "diondctl: cannot read %s %s\n", flag, path.c_str());
      return false;
    }
  }
  c->channel = grpc::CreateChannel(c->target, grpc::SslCredentials(ssl));
  return true;
}

void Prepare(const Connection& c, grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  if (!c.token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", c.token));
}

int Fail(const Connection& c, const grpc::Status& s) {
  // gRPC's status codes are absl's, number for number.
  std::fprintf(stderr, "diondctl: %s: %s: %s\n", c.target.c_str(),
               absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())).c_str(),
               s.error_message().c_str());
  return 1;
}

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

// ---- formatting ------------------------------------------------------------------------------

using diondctl::Bytes;

std::string Ago(int64_t unix_micros, absl::Time now) {
  if (unix_micros == 0) return "-";
  absl::Duration d = absl::Trunc(now - absl::FromUnixMicros(unix_micros), absl::Seconds(1));
  if (d <= absl::ZeroDuration()) return "0s ago";
  return absl::StrCat(absl::FormatDuration(d), " ago");
}

std::string AlgorithmName(int a) {
  std::string n = diond::v1::Algorithm_Name(static_cast<diond::v1::Algorithm>(a));
  return absl::AsciiStrToLower(absl::StripPrefix(n, "ALGORITHM_"));
}

std::string StateName(int s) {
  std::string n = diond::v1::SessionState_Name(static_cast<diond::v1::SessionState>(s));
  return absl::AsciiStrToLower(absl::StripPrefix(n, "SESSION_STATE_"));
}

std::string Groups(const SessionInfo& s) {
  std::vector<std::string> g;
  for (const auto& group : s.groups()) {
    g.push_back(absl::StrCat(group.name(), ":", AlgorithmName(group.algorithm())));
  }
  return g.empty() ? "-" : absl::StrJoin(g, ",");
}

// A text table: one Column per field; adding a column is adding one entry.
template <typename Row>
struct Column {
  std::string header;
  std::function<std::string(const Row&)> cell;
};

template <typename Row>
void PrintTable(const std::vector<Column<Row>>& columns, const std::vector<Row>& rows) {
  std::vector<std::vector<std::string>> cells;
  std::vector<size_t> width;
  width.reserve(columns.size());
  cells.reserve(rows.size());
  for (const auto& c : columns) width.push_back(c.header.size());
  for (const Row& r : rows) {
    std::vector<std::string> line;
    line.reserve(columns.size());
    for (size_t i = 0; i < columns.size(); ++i) {
      line.push_back(columns[i].cell(r));
      width[i] = std::max(width[i], line.back().size());
    }
    cells.push_back(std::move(line));
  }
  auto print = [&](const std::vector<std::string>& line) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      absl::StrAppend(&out, line[i],
                      i + 1 < line.size() ? std::string(width[i] - line[i].size() + 2, ' ') : "");
    }
    std::printf("%s\n", out.c_str());
  };
  std::vector<std::string> headers;
  headers.reserve(columns.size());
  for (const auto& c : columns) headers.push_back(c.header);
  print(headers);
  for (const auto& line : cells) print(line);
}

// The session listing's columns. The owner column is printed when the daemon's SessionInfo has
// an `owner` field (read through reflection, so this file builds with and without it).
std::vector<Column<SessionInfo>> SessionColumns(absl::Time now) {
  std::vector<Column<SessionInfo>> cols = {
      {"SESSION", [](const SessionInfo& s) { return s.session_id(); }},
      {"CLIENT",
       [](const SessionInfo& s) { return s.client_name().empty() ? "-" : s.client_name(); }},
      {"GROUPS", [](const SessionInfo& s) { return Groups(s); }},
      {"PARAMS", [](const SessionInfo& s) { return absl::StrCat(s.parameters()); }},
      {"STATE_BYTES", [](const SessionInfo& s) { return Bytes(s.state_bytes()); }},
      {"STEP", [](const SessionInfo& s) { return absl::StrCat(s.last_step_index()); }},
      {"LAST_STEP", [now](const SessionInfo& s) { return Ago(s.last_step_unix_micros(), now); }},
      {"CHECKPOINT",
       [](const SessionInfo& s) {
         return s.last_checkpoint_step() == 0 && s.last_checkpoint_path().empty()
                    ? std::string("-")
                    : absl::StrCat("step ", s.last_checkpoint_step());
       }},
      {"STATE", [](const SessionInfo& s) { return StateName(s.state()); }},
  };
  const auto* owner = SessionInfo::descriptor()->FindFieldByName("owner");
  if (owner != nullptr && owner->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
      !owner->is_repeated()) {
    cols.insert(cols.begin() + 1, {"OWNER", [owner](const SessionInfo& s) {
                                     std::string o = s.GetReflection()->GetString(s, owner);
                                     return o.empty() ? std::string("-") : o;
                                   }});
  }
  return cols;
}

// ---- commands --------------------------------------------------------------------------------

int Health(const Connection& c, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(c.channel);
  grpc::ClientContext ctx;
  Prepare(c, &ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    std::fprintf(stderr, "diondctl: %s: health check failed: %s\n", c.target.c_str(),
                 s.error_message().c_str());
    return 1;
  }
  const std::string status =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n",
                nlohmann::json{{"target", c.target}, {"service", service}, {"status", status}}
                    .dump()
                    .c_str());
  } else {
    std::printf("%s %s\n", c.target.c_str(), status.c_str());
  }
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

bool ListSessions(const Connection& c, diond::v1::ListSessionsResponse* resp, int* rc) {
  auto stub = diond::v1::Optimizer::NewStub(c.channel);
  grpc::ClientContext ctx;
  Prepare(c, &ctx);
  grpc::Status s = stub->ListSessions(&ctx, diond::v1::ListSessionsRequest(), resp);
  if (!s.ok()) *rc = Fail(c, s);
  return s.ok();
}

int Sessions(const Connection& c) {
  diond::v1::ListSessionsResponse resp;
  int rc = 0;
  if (!ListSessions(c, &resp, &rc)) return rc;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(resp).c_str());
    return 0;
  }
  std::vector<SessionInfo> rows(resp.sessions().begin(), resp.sessions().end());
  std::sort(rows.begin(), rows.end(), [](const SessionInfo& a, const SessionInfo& b) {
    return a.session_id() < b.session_id();
  });
  PrintTable(SessionColumns(absl::Now()), rows);
  std::printf("%d session(s)\n", resp.sessions_size());
  return 0;
}

int Inspect(const Connection& c, const std::string& id) {
  diond::v1::ListSessionsResponse resp;
  int rc = 0;
  if (!ListSessions(c, &resp, &rc)) return rc;
  for (const SessionInfo& s : resp.sessions()) {
    if (s.session_id() != id) continue;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("%s\n", ToJson(s).c_str());
      return 0;
    }
    const absl::Time now = absl::Now();
    auto when = [&](int64_t us) {
      return us == 0 ? std::string("-")
                     : absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMicros(us),
                                                     absl::UTCTimeZone()),
                                    " (", Ago(us, now), ")");
    };
    // Every field, by reflection order, so a field added to SessionInfo shows up here too.
    std::printf("session             %s\n", s.session_id().c_str());
    std::printf("state               %s\n", StateName(s.state()).c_str());
    std::printf("client              %s\n", s.client_name().c_str());
    const auto* owner = SessionInfo::descriptor()->FindFieldByName("owner");
    if (owner != nullptr && owner->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
        !owner->is_repeated()) {
      std::printf("owner               %s\n", s.GetReflection()->GetString(s, owner).c_str());
    }
    std::printf("world key           %s\n",
                s.world_key().empty() ? "- (local session)" : s.world_key().c_str());
    std::printf("parameters          %lld\n", static_cast<long long>(s.parameters()));
    std::printf("state bytes         %s (%lld)\n", Bytes(s.state_bytes()).c_str(),
                static_cast<long long>(s.state_bytes()));
    std::printf("host bytes          %s (%lld)\n", Bytes(s.host_bytes()).c_str(),
                static_cast<long long>(s.host_bytes()));
    std::printf("last step           %lld\n", static_cast<long long>(s.last_step_index()));
    std::printf("last step at        %s\n", when(s.last_step_unix_micros()).c_str());
    std::printf("last used at        %s\n", when(s.last_used_unix_micros()).c_str());
    std::printf("last checkpoint     %s\n", s.last_checkpoint_path().empty()
                                                ? "-"
                                                : absl::StrCat("step ", s.last_checkpoint_step(),
                                                               " at ", s.last_checkpoint_path())
                                                      .c_str());
    std::printf("last checkpoint at  %s\n", when(s.last_checkpoint_unix_micros()).c_str());
    std::printf("groups:\n");
    std::vector<diond::v1::SessionGroupInfo> groups(s.groups().begin(), s.groups().end());
    PrintTable<diond::v1::SessionGroupInfo>(
        {{"  GROUP", [](const auto& g) { return absl::StrCat("  ", g.name()); }},
         {"ALGORITHM", [](const auto& g) { return AlgorithmName(g.algorithm()); }},
         {"PARAMS", [](const auto& g) { return absl::StrCat(g.parameters()); }}},
        groups);
    return 0;
  }
  std::fprintf(stderr, "diondctl: %s: no session '%s'\n", c.target.c_str(), id.c_str());
  return 1;
}

int Checkpoint(const Connection& c, const std::string& id) {
  auto stub = diond::v1::Optimizer::NewStub(c.channel);
  grpc::ClientContext ctx;
  Prepare(c, &ctx);
  diond::v1::SaveCheckpointRequest req;
  req.set_session_id(id);
  req.set_directory(absl::GetFlag(FLAGS_dir));
  diond::v1::SaveCheckpointResponse resp;
  grpc::Status s = stub->SaveCheckpoint(&ctx, req, &resp);
  if (!s.ok()) return Fail(c, s);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(resp).c_str());
  } else {
    std::printf("session %s: checkpoint of step %lld written to %s (%s)\n", id.c_str(),
                static_cast<long long>(resp.step_index()), resp.path().c_str(),
                Bytes(resp.bytes()).c_str());
  }
  return 0;
}

int Close(const Connection& c, const std::string& id) {
  auto stub = diond::v1::Optimizer::NewStub(c.channel);
  grpc::ClientContext ctx;
  Prepare(c, &ctx);
  diond::v1::CloseSessionRequest req;
  req.set_session_id(id);
  diond::v1::CloseSessionResponse resp;
  grpc::Status s = stub->CloseSession(&ctx, req, &resp);
  if (!s.ok()) return Fail(c, s);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", nlohmann::json{{"session_id", id}, {"closed", true}}.dump().c_str());
  } else {
    std::printf("session %s closed\n", id.c_str());
  }
  return 0;
}

int World(const Connection& c) {
  auto stub = diond::v1::Peer::NewStub(c.channel);
  grpc::ClientContext ctx;
  Prepare(c, &ctx);
  // The same header as the daemons' PeerClient (server/rpc/auth.h kWorldSecretMetadata).
  if (!c.world_secret.empty()) ctx.AddMetadata("x-diond-world-secret", c.world_secret);
  diond::v1::GetMembershipResponse resp;
  grpc::Status s = stub->GetMembership(&ctx, diond::v1::GetMembershipRequest(), &resp);
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    std::fprintf(stderr,
                 "diondctl: %s serves no world membership: it is not the coordinator (rank 0) "
                 "of a world, or runs with --world_size=1\n",
                 c.target.c_str());
    return 1;
  }
  if (!s.ok()) return Fail(c, s);
  const diond::v1::Membership& m = resp.membership();
  std::map<int, const diond::v1::PeerMember*> by_rank;
  for (const auto& p : m.members()) by_rank[p.rank()] = &p;
  std::vector<int> lost;
  for (int r = 0; r < m.world_size(); ++r) {
    auto it = by_rank.find(r);
    if (it == by_rank.end() || !it->second->live()) lost.push_back(r);
  }
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j = nlohmann::json::parse(ToJson(m));
    j["lost_ranks"] = lost;
    std::printf("%s\n", j.dump().c_str());
    return lost.empty() ? 0 : 1;
  }
  std::printf("world of %d, generation %llu, %s\n", m.world_size(),
              static_cast<unsigned long long>(m.generation()),
              m.complete() ? "complete" : "INCOMPLETE");
  if (!m.broken_reason().empty()) std::printf("last break: %s\n", m.broken_reason().c_str());
  std::vector<int> ranks;
  ranks.reserve(m.world_size());
  for (int r = 0; r < m.world_size(); ++r) ranks.push_back(r);
  PrintTable<int>({{"RANK", [](int r) { return absl::StrCat(r); }},
                   {"ADDRESS",
                    [&](int r) {
                      auto it = by_rank.find(r);
                      return it == by_rank.end() ? std::string("-") : it->second->address();
                    }},
                   {"STATE",
                    [&](int r) {
                      auto it = by_rank.find(r);
                      if (it == by_rank.end()) return std::string("never joined");
                      return std::string(it->second->live() ? "live" : "lost");
                    }},
                   {"INCARNATION",
                    [&](int r) {
                      auto it = by_rank.find(r);
                      return it == by_rank.end()
                                 ? std::string("-")
                                 : absl::StrFormat("%016x", it->second->incarnation());
                    }}},
                  ranks);
  std::printf("lost ranks: %s\n", lost.empty() ? "none" : absl::StrJoin(lost, ", ").c_str());
  return lost.empty() ? 0 : 1;
}

constexpr char kUsage[] =
    "diondctl: talk to a diond daemon.\n"
    "  diondctl [flags] health [SERVICE]\n"
    "  diondctl [flags] sessions\n"
    "  diondctl [flags] session inspect ID\n"
    "  diondctl [flags] checkpoint ID [--dir=DIR]\n"
    "  diondctl [flags] close ID\n"
    "  diondctl [flags] world            (target: the world's rank 0)\n"
    "  diondctl [flags] top [--metrics_url=URL] [--interval=2s] [--iterations=N]\n"
    "Every command takes --json.";

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  auto usage = [](const char* why) {
    std::fprintf(stderr, "diondctl: %s\n%s\n", why, kUsage);
    return 2;
  };
  if (args.size() < 2) return usage("missing command");
  const std::string cmd = args[1];
  const size_t n = args.size();
  if (cmd == "top") return n == 2 ? diondctl::Top() : usage("top takes no argument");
  Connection c;
  if (!Connect(&c)) return 1;
  if (cmd == "health" && n <= 3) return Health(c, n == 3 ? args[2] : "");
  if (cmd == "sessions" && n == 2) return Sessions(c);
  if (cmd == "session" && n == 4 && std::string(args[2]) == "inspect") return Inspect(c, args[3]);
  if (cmd == "checkpoint" && n == 3) return Checkpoint(c, args[2]);
  if (cmd == "close" && n == 3) return Close(c, args[2]);
  if (cmd == "world" && n == 2) return World(c);
  return usage(absl::StrCat("unknown command or wrong arguments: ",
                            absl::StrJoin(args.begin() + 1, args.end(), " "))
                   .c_str());
}
