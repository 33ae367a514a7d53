// auth_probe: a client process for the authentication tests (auth_service_test.cc). Started as
// root, it first becomes another user (--uid, setresuid) when asked, so that the daemon sees a
// foreign uid on its Unix socket, then connects with the credentials given (none, a bearer
// token, TLS, mutual TLS) and runs one command, printing one line per RPC:
//
//   create                    CreateSession (one 4x4 AdamW parameter) -> "session <id>"
//   list                      ListSessions -> "listed <id> <owner>" lines, then "count <n>"
//   all <session>             every RPC that names the session -> "<Rpc> <CODE>" lines; the
//                             mutating ones carry harmful values (NaN state, lr=1e6), so
//                             that a refusal is what keeps them out; CloseSession comes last
//   pull <session>            PullParameters -> "pull <CODE> <fnv1a of the bytes>"
//   register <session> <shm>  RegisterRegion of an existing shm segment -> "register <CODE>"
//
// Errors before the command print "error <message>" and exit 2.
#include <grp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/credentials.h"
#include "tests/service/service_harness.h"

namespace {

namespace v1 = ::diond::v1;
using namespace ::diond::service_testing;  // NOLINT: a test tool

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// gRPC's codes are absl's (the same numbers and names).
std::string Code(const grpc::Status& s) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()));
}

void Print(const std::string& rpc, const grpc::Status& s) {
  std::printf("%s %s\n", rpc.c_str(), Code(s).c_str());
  std::fflush(stdout);
}

int Fail(const std::string& what) {
  std::printf("error %s\n", what.c_str());
  return 2;
}

void All(v1::Optimizer::Stub& stub, const std::string& id) {
  {
    v1::RegisterRegionRequest r;
    r.set_session_id(id);
    r.set_role(v1::REGION_ROLE_PARAMETERS);
    r.set_kind(v1::REGION_KIND_SYSTEM_SHM);
    r.mutable_system_shm()->set_name("diond-auth-probe-no-such-segment");
    r.mutable_system_shm()->set_size_bytes(64);
    v1::RegisterRegionResponse resp;
    Print("RegisterRegion", stub.RegisterRegion(Ctx().get(), r, &resp));
  }
  {
    v1::UnregisterRegionRequest r;
    r.set_session_id(id);
    r.set_region_id("params-1");
    v1::UnregisterRegionResponse resp;
    Print("UnregisterRegion", stub.UnregisterRegion(Ctx().get(), r, &resp));
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Print("PushGradients",
        PushGradients(stub, id, {{"w", 0, FloatBytes(std::vector<float>(16, 1))}}));
  {
    v1::StepRequest r;
    r.set_session_id(id);
    r.set_step_index(1);
    v1::StepResponse resp;
    Print("Step", stub.Step(Ctx().get(), r, &resp));
  }
  TensorMap m;
  Print("PullParameters", PullParameters(stub, id, &m));
  {
    v1::SetHyperparametersRequest r;
    r.set_session_id(id);
    r.set_group("g");
    r.mutable_hyperparameters()->set_lr(1e6);
    v1::SetHyperparametersResponse resp;
    Print("SetHyperparameters", stub.SetHyperparameters(Ctx().get(), r, &resp));
  }
  Print("GetState", GetState(stub, id, true, &m));
  Print("SetState", SetState(stub, id, {{"w", 0, FloatBytes(std::vector<float>(16, nan))}}));
  {
    v1::SaveCheckpointRequest r;
    r.set_session_id(id);
    r.set_directory("probe-ckpt");
    v1::SaveCheckpointResponse resp;
    Print("SaveCheckpoint", stub.SaveCheckpoint(Ctx().get(), r, &resp));
  }
  {
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    v1::CloseSessionResponse resp;
    Print("CloseSession", stub.CloseSession(Ctx().get(), r, &resp));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string target, token, tls_ca, tls_cert, tls_key, server_name;
  int uid = -1;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&a](const char* flag, std::string* out) {
      if (!absl::StartsWith(a, absl::StrCat(flag, "="))) return false;
      *out = a.substr(std::string(flag).size() + 1);
      return true;
    };
    std::string uid_text;
    if (value("--target", &target) || value("--token", &token) || value("--tls_ca", &tls_ca) ||
        value("--tls_cert", &tls_cert) || value("--tls_key", &tls_key) ||
        value("--server_name", &server_name)) {
      continue;
    }
    if (value("--uid", &uid_text)) {
      if (!absl::SimpleAtoi(uid_text, &uid)) return Fail("bad --uid");
      continue;
    }
    args.push_back(a);
  }
  if (target.empty() || args.empty()) return Fail("usage: auth_probe --target=T [...] COMMAND");
  if (uid >= 0) {
    // Become the other user before gRPC starts any thread.
    if (setgroups(0, nullptr) != 0 || setresgid(uid, uid, uid) != 0 ||
        setresuid(uid, uid, uid) != 0) {
      return Fail("cannot become uid " + std::to_string(uid));
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls_ca.empty()) {
    grpc::SslCredentialsOptions so;
    so.pem_root_certs = Slurp(tls_ca);
    if (!tls_cert.empty()) {
      so.pem_cert_chain = Slurp(tls_cert);
      so.pem_private_key = Slurp(tls_key);
    }
    creds = grpc::SslCredentials(so);
  }
  std::shared_ptr<grpc::Channel> channel = TokenChannel(target, token, creds);
  auto stub = v1::Optimizer::NewStub(channel);
  const std::string& cmd = args[0];
  if (cmd == "create") {
    SessionDesc d;
    d.groups.push_back(MakeGroup("g", diond::optim::AlgorithmKind::kAdamW, 0.01));
    d.params.push_back({"w", {4, 4}, "g"});
    v1::CreateSessionResponse resp;
    grpc::Status s = stub->CreateSession(Ctx().get(), d.Request(), &resp);
    if (!s.ok()) {
      Print("CreateSession", s);
      return 1;
    }
    // Parameters the owner can recognise later.
    std::vector<float> w(16);
    for (int i = 0; i < 16; ++i) w[i] = 0.25f * static_cast<float>(i);
    grpc::Status st = SetState(*stub, resp.session_id(), {{"w", 0, FloatBytes(w)}});
    if (!st.ok()) Print("SetState", st);
    std::printf("session %s\n", resp.session_id().c_str());
    return 0;
  }
  if (cmd == "list") {
    v1::ListSessionsResponse resp;
    grpc::Status s = stub->ListSessions(Ctx().get(), v1::ListSessionsRequest(), &resp);
    if (!s.ok()) {
      Print("ListSessions", s);
      return 1;
    }
    for (const auto& i : resp.sessions()) {
      std::printf("listed %s %s\n", i.session_id().c_str(), i.owner().c_str());
    }
    std::printf("count %d\n", resp.sessions_size());
    return 0;
  }
  if (cmd == "all" && args.size() == 2) {
    All(*stub, args[1]);
    return 0;
  }
  if (cmd == "pull" && args.size() == 2) {
    TensorMap m;
    grpc::Status s = PullParameters(*stub, args[1], &m);
    std::printf("pull %s %llx\n", Code(s).c_str(),
                static_cast<unsigned long long>(Fnv1a(s.ok() ? m["w"] : "")));
    return 0;
  }
  if (cmd == "register" && args.size() == 3) {
    v1::RegisterRegionRequest r;
    r.set_session_id(args[1]);
    r.set_role(v1::REGION_ROLE_PARAMETERS);
    r.set_kind(v1::REGION_KIND_SYSTEM_SHM);
    r.mutable_system_shm()->set_name(args[2]);
    r.mutable_system_shm()->set_size_bytes(64);
    v1::RegisterRegionResponse resp;
    Print("register", stub->RegisterRegion(Ctx().get(), r, &resp));
    return 0;
  }
  return Fail("unknown command " + cmd);
}
