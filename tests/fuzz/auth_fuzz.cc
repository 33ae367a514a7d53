// libFuzzer target (main-build mode only, -DDIOND_BUILD_FUZZERS=ON): the Optimizer service's
// authentication and access checks, with the server's own code:
//   - Authenticator::Authenticate on what a call presents: its peer string (Unix connections
//     recorded with their SO_PEERCRED uid, unknown "fd:" numbers, TCP peers, raw bytes), its
//     "authorization" metadata (the right bearer tokens, and the same cut short, lengthened, with
//     one byte changed, in another case, with blanks, or raw bytes) and a TLS certificate
//     subject, under every combination of --allow_unauthenticated_tcp and mTLS;
//   - ParseTokenFile on the bytes of a --auth_token_file;
//   - the ownership checks (OwnedSession, MayUseSession as ListSessions filters,
//     SessionManager::Attach, LoadCheckpoint with the caller) of three live sessions owned by a
//     local uid, a token principal and a certificate subject;
//   - checkpoint paths: CheckPathAllowed, then OpenCheckpointDir (read and create) and
//     SaveCheckpoint under a --state_dir that holds symlinks out of it (absolute and relative),
//     a symlink inside it, a symlink loop and a plain file, with "..", absolute paths, long names
//     and NUL bytes from the input.
// Properties, checked against a model written here from docs/OPERATIONS.md "Security" (not from
// the code under test):
//  - the principal (name, admin, local) or UNAUTHENTICATED is the model's; no message echoes a
//    token;
//  - a principal uses a session iff it is an admin or the session's owner; ListSessions shows
//    exactly those; any other is PERMISSION_DENIED (NOT_FOUND for an unknown id);
//  - a non-admin loads only checkpoints it owns, and the restored session keeps its owner;
//  - whatever a caller that is not a local admin names, a directory opened or created for it
//    lies beneath the state dir (its /proc/self/fd link), nothing outside the state dir is
//    created, and a path with a NUL byte is refused (the opened path would not be the named one);
//  - every error message is bounded and one line.
// Input: one byte of daemon options (bit 0 --allow_unauthenticated_tcp, bit 1 mTLS), then
// records of one byte (the operation), two bytes of length (little-endian) and the payload; the
// first bytes of a payload choose the caller (peer, credential, certificate), the rest is the
// operation's argument. See `Caller` below.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "diond/v1/optimizer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/checkpoint/directory_store.h"
#include "server/checkpoint/sandbox.h"
#include "server/rpc/access.h"
#include "server/rpc/auth.h"
#include "server/rpc/convert.h"
#include "server/session/session_manager.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

namespace fs = std::filesystem;
using diond::rpc::Principal;

std::string g_root;       // the harness's folder: state/ and outside/
std::string g_state_dir;  // <root>/state
std::string g_outside;    // <root>/outside
std::string g_state_real;

// The daemon's credentials (a --auth_token_file of three lines).
struct Token {
  const char* token;
  const char* principal;
  bool admin;
};
constexpr Token kTokens[] = {
    {"alice-token-0123456789abcdef", "alice", false},
    {"bob-token-ZYXWVUTSRQPONMLKJIHG", "bob", false},
    {"ops-token-!#$%&'()*+,-./:;<=>?@", "ops", true},
};
// Unix connections the listener accepted (fd -> uid); fd 6 is not one.
constexpr int kUnixFds[] = {3, 4, 5};
uid_t UnixUid(int fd) { return fd == 3 ? 1000 : fd == 4 ? 0 : geteuid(); }

using diond::fuzz::Records;
using diond::fuzz::Require;

// `sent`: what the caller sent besides its credential (a path may hold any bytes, a token's
// included, and its echo then repeats the caller's own input). A message never shows one of the
// daemon's tokens that the caller did not send there.
void RequireBounded(const absl::Status& s, absl::string_view sent = {}) {
  diond::fuzz::RequireBoundedMessage(s, 2048);
  for (const Token& t : kTokens) {
    Require(!absl::StrContains(s.message(), t.token) || absl::StrContains(sent, t.token),
            "a message echoes a token");
  }
}

// Takes one byte of `s` (0 when empty).
int Take(std::string* s) {
  if (s->empty()) return 0;
  int b = static_cast<unsigned char>((*s)[0]);
  s->erase(0, 1);
  return b;
}

// Takes a length-prefixed string (one byte of length) of `s`.
std::string TakeString(std::string* s) {
  size_t n = std::min<size_t>(static_cast<size_t>(Take(s)), s->size());
  std::string out = s->substr(0, n);
  s->erase(0, n);
  return out;
}

// The caller a payload describes: three selector bytes (peer, credential, certificate) and the
// raw strings some of them take.
diond::rpc::CallCredentials Caller(std::string* payload) {
  diond::rpc::CallCredentials c;
  const int peer = Take(payload), cred = Take(payload), cert = Take(payload);
  switch (peer % 6) {
    case 0:
    case 1:
    case 2:
      c.peer = absl::StrCat("fd:", kUnixFds[peer % 6]);
      break;
    case 3:
      c.peer = "fd:6";
      break;  // a number the listener never recorded
    case 4:
      c.peer = "ipv4:127.0.0.1:40000";
      break;
    default:
      c.peer = TakeString(payload);
      break;
  }
  const Token& t = kTokens[(cred / 16) % 3];
  const std::string token = t.token;
  switch (cred % 16) {
    case 0:
      break;  // no authorization metadata
    case 1:
      c.authorization = "Bearer " + token;
      break;
    case 2:
      c.authorization = "Bearer " + token.substr(0, token.size() - 1 - cred % 5);
      break;
    case 3:
      c.authorization = "Bearer " + token + static_cast<char>(Take(payload));
      break;
    case 4: {
      std::string bad = token;
      bad[static_cast<size_t>(Take(payload)) % bad.size()] ^=
          static_cast<char>(1 + Take(payload) % 255);
      c.authorization = "Bearer " + bad;
      break;
    }
    case 5:
      c.authorization = "bearer " + token;
      break;
    case 6:
      c.authorization = "Bearer  " + token + " \t";
      break;
    case 7:
      c.authorization = token;
      break;
    case 8:
      c.authorization = "Bearer ";
      break;
    case 9:
      c.authorization = "Bearer " + token + token;
      break;
    default:
      c.authorization = TakeString(payload);
      break;
  }
  c.has_authorization = cred % 16 != 0;
  switch (cert % 4) {
    case 0:
      break;
    case 1:
      c.certificate_subject = "CN=carol,O=diond-test";
      break;
    case 2:
      c.certificate_subject = TakeString(payload);
      break;
    default:
      c.certificate_subject = std::string(600, 'x');
      break;
  }
  return c;
}

// The model of docs/OPERATIONS.md "Security": who the call is, or UNAUTHENTICATED.
struct Expected {
  bool ok = false;
  Principal p;
};

Expected Model(const diond::rpc::CallCredentials& c, bool allow_tcp, bool mtls) {
  Expected e;
  for (int fd : kUnixFds) {
    if (c.peer == absl::StrCat("fd:", fd)) {
      const uid_t uid = UnixUid(fd);
      e.ok = true;
      e.p.name = absl::StrCat("uid:", uid);
      e.p.admin = uid == 0 || uid == geteuid();
      e.p.local = true;
      e.p.uid = uid;
      return e;
    }
  }
  if (c.has_authorization) {
    if (c.authorization.rfind("Bearer ", 0) != 0) return e;
    const std::string given(absl::StripAsciiWhitespace(c.authorization.substr(7)));
    for (const Token& t : kTokens) {
      if (given == t.token) {
        e.ok = true;
        e.p.name = t.principal;
        e.p.admin = t.admin;
        return e;
      }
    }
    return e;  // a wrong token never falls through to a certificate or "anonymous"
  }
  if (mtls && !c.certificate_subject.empty()) {
    e.ok = true;
    e.p.name = "x509:" + c.certificate_subject.substr(0, 512);
    return e;
  }
  if (allow_tcp) {
    e.ok = true;
    e.p.name = "anonymous";
  }
  return e;
}

// True when `fd` is a directory beneath the state dir (or the state dir).
bool BeneathState(int fd) {
  std::error_code ec;
  const fs::path real = fs::read_symlink(absl::StrCat("/proc/self/fd/", fd), ec);
  if (ec) return false;
  const std::string r = real.string();
  return r == g_state_real || absl::StartsWith(r, g_state_real + "/");
}

// Everything under `dir` (relative names), to see that nothing was created there.
std::vector<std::string> Tree(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    out.push_back(it->path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void ResetTree() {
  std::error_code ec;
  fs::remove_all(g_state_dir, ec);
  fs::remove_all(g_outside, ec);
  fs::create_directories(g_state_dir + "/sub/deeper", ec);
  fs::create_directories(g_outside + "/victim", ec);
  Require(!ec, "create the harness's folders");
  Require(symlink(g_outside.c_str(), (g_state_dir + "/link_out").c_str()) == 0, "symlink");
  Require(symlink("../outside", (g_state_dir + "/link_up").c_str()) == 0, "symlink");
  Require(symlink("sub", (g_state_dir + "/link_in").c_str()) == 0, "symlink");
  Require(symlink("loop", (g_state_dir + "/loop").c_str()) == 0, "symlink");
  Require(symlink("../../outside", (g_state_dir + "/sub/link_up2").c_str()) == 0, "symlink");
  int f = open((g_state_dir + "/file").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  Require(f >= 0, "create state/file");
  close(f);
}

diond::v1::CreateSessionRequest SessionRequest(const std::string& name) {
  diond::v1::CreateSessionRequest req;
  req.set_client_name("auth_fuzz");
  req.set_session_name(name);
  auto* g = req.add_groups();
  g->set_name("g");
  g->set_algorithm(diond::v1::ALGORITHM_ADAMW);
  auto* w = req.add_parameters();
  w->set_name("w");
  w->set_group("g");
  w->set_dtype(diond::v1::DTYPE_F32);
  w->add_shape(4);
  return req;
}

// The sessions every input starts with, by owner.
constexpr const char* kOwners[] = {"uid:1000", "alice", "x509:CN=carol,O=diond-test"};
constexpr const char* kNames[] = {"s-uid", "s-alice", "s-carol"};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  diond::fuzz::QuietLogs();
  char tmpl[] = "/tmp/diond-auth-fuzz.XXXXXX";
  Require(mkdtemp(tmpl) != nullptr, "mkdtemp");
  g_root = tmpl;
  g_state_dir = g_root + "/state";
  g_outside = g_root + "/outside";
  ResetTree();
  std::error_code ec;
  g_state_real = fs::canonical(g_state_dir, ec).string();
  Require(!ec, "canonical state dir");
  static std::string root = g_root;
  std::atexit([] {
    std::error_code e;
    fs::remove_all(root, e);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool allow_tcp = (data[0] & 1) != 0, mtls = (data[0] & 2) != 0;
  ResetTree();
  std::vector<std::string> outside_before = Tree(g_outside);

  diond::rpc::AuthOptions auth_options;
  std::string token_file = "# the harness's tokens\n";
  for (const Token& t : kTokens) {
    absl::StrAppend(&token_file, t.token, " ", t.principal, t.admin ? " admin" : "", "\n");
  }
  auto tokens = diond::rpc::ParseTokenFile(token_file);
  Require(tokens.ok() && tokens->size() == 3, "the harness's token file parses");
  auth_options.tokens = *std::move(tokens);
  auth_options.allow_unauthenticated_tcp = allow_tcp;
  auth_options.tls_client_certs = mtls;
  diond::rpc::Authenticator auth(std::move(auth_options));
  for (int fd : kUnixFds) auth.unix_peers()->Record(fd, UnixUid(fd));

  diond::session::ManagerOptions options;
  options.state_dir = g_state_dir;
  options.checkpoints = std::make_shared<diond::checkpoint::DirectoryStore>(g_state_dir);
  options.compute_threads = 1;
  auto manager = diond::session::SessionManager::Create(options);
  Require(manager.ok(), "SessionManager::Create");
  std::vector<std::string> ids;
  std::vector<std::string> owner_of_id;
  for (int i = 0; i < 3; ++i) {
    auto spec = diond::rpc::SpecFromProto(SessionRequest(kNames[i]));
    Require(spec.ok(), "the harness's session spec");
    spec->owner = kOwners[i];
    auto s = (*manager)->CreateSession(*std::move(spec));
    Require(s.ok(), "CreateSession");
    ids.push_back((*s)->id());
    owner_of_id.push_back(kOwners[i]);
  }
  // Checkpoints the owners saved, relative to the state dir: of unnamed twins of the three
  // sessions (a checkpoint of a named one cannot be loaded while it lives: ALREADY_EXISTS).
  std::vector<std::string> saved(3);
  for (int i = 0; i < 3; ++i) {
    auto spec = diond::rpc::SpecFromProto(SessionRequest(""));
    Require(spec.ok(), "the harness's session spec");
    spec->owner = kOwners[i];
    auto twin = (*manager)->CreateSession(*std::move(spec));
    Require(twin.ok(), "CreateSession");
    // Weights held by the daemon (as after a SetState stream): 4 f32 values.
    std::vector<diond::session::TensorWrite> weights{{"w", 0, std::string(16, '\0')}};
    Require((*twin)->ApplyStateWrites(weights).ok(), "the harness's SetState");
    auto r = (*manager)->SaveCheckpoint((*twin)->id(), "");
    if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    Require(r.ok(), "the harness's SaveCheckpoint");
    saved[i] = r->first.substr(g_state_dir.size() + 1);
  }

  Records in(reinterpret_cast<const char*>(data) + 1, size - 1);
  int kind = 0;
  std::string payload;
  for (int op = 0; op < 64 && in.Next(&kind, &payload); ++op) {
    if (kind % 8 == 7) {  // a token file's bytes
      auto parsed = diond::rpc::ParseTokenFile(payload);
      if (!parsed.ok()) {
        RequireBounded(parsed.status());
        for (absl::string_view field :
             absl::StrSplit(payload, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
          Require(field.size() < 16 || !absl::StrContains(parsed.status().message(), field),
                  "a token file refusal echoes a token");
        }
      } else {
        for (const auto& e : *parsed) {
          Require(!e.principal.empty() && e.principal.size() <= 128 && e.digest.size() == 32,
                  "an accepted token entry is out of its bounds");
        }
      }
      continue;
    }
    const diond::rpc::CallCredentials call = Caller(&payload);
    const std::string sent = payload;  // the operation's bytes: ids, names, paths
    const Expected want = Model(call, allow_tcp, mtls);
    absl::StatusOr<Principal> got = auth.Authenticate(call);
    if (!got.ok()) {
      RequireBounded(got.status());
      Require(got.status().code() == absl::StatusCode::kUnauthenticated,
              "a refused credential is not UNAUTHENTICATED");
      Require(!want.ok, "a valid credential was refused");
      continue;
    }
    Require(want.ok, "an invalid credential was accepted");
    Require(got->name == want.p.name && got->admin == want.p.admin && got->local == want.p.local &&
                (!want.p.local || got->uid == want.p.uid),
            "the principal is not the model's");
    const Principal& p = *got;
    const int which = Take(&payload);
    const int target = which % 4;  // 3: an id from the payload
    const std::string id = target < 3 ? ids[target] : TakeString(&payload);
    const bool known = target < 3 || std::find(ids.begin(), ids.end(), id) != ids.end();
    const bool may = target < 3 ? (p.admin || p.name == owner_of_id[target]) : false;
    switch (kind % 8) {
      case 0: {  // any RPC that names a session
        auto s = diond::rpc::OwnedSession(manager->get(), p, id);
        if (!s.ok()) RequireBounded(s.status(), sent);
        if (target < 3) {
          Require(s.ok() == may, "a session was used by a principal that does not own it");
          if (!may) {
            Require(s.status().code() == absl::StatusCode::kPermissionDenied,
                    "another principal's session is not PERMISSION_DENIED");
          }
        } else if (!known) {
          Require(s.status().code() == absl::StatusCode::kNotFound, "an unknown id was found");
        }
        break;
      }
      case 1: {  // ListSessions
        int seen = 0, want_seen = 0;
        for (const auto& info : (*manager)->List())
          seen += diond::rpc::MayUseSession(p, info.owner);
        for (const char* o : kOwners) want_seen += 2 * (p.admin || p.name == o);  // and twins
        Require(seen == want_seen, "ListSessions shows another principal's sessions");
        break;
      }
      case 2: {  // AttachSession by name
        const std::string name = target < 3 ? kNames[target] : id;
        auto s = (*manager)->Attach(name, p.name, {}, p.admin);
        if (!s.ok()) RequireBounded(s.status(), sent);
        if (target < 3) Require(s.ok() == may, "Attach ignored the session's owner");
        break;
      }
      case 3: {  // LoadCheckpoint of an owner's checkpoint
        const std::string path = target < 3 ? saved[target] : id;
        absl::Status allowed = diond::rpc::CheckPathAllowed(p, path, "path");
        if (!allowed.ok()) {
          RequireBounded(allowed, sent);
          break;
        }
        if (!path.empty() && path[0] == '/') break;  // a local admin's path: not the harness's
        auto s = (*manager)->LoadCheckpoint(path, {}, diond::session::Caller{p.name, p.admin});
        if (!s.ok()) {
          RequireBounded(s.status(), sent);
          if (target < 3) {
            Require(!may, "an owner could not load its own checkpoint");
            Require(s.status().code() == absl::StatusCode::kPermissionDenied,
                    "another principal's checkpoint is not PERMISSION_DENIED");
          }
          break;
        }
        Require(p.admin || (*s)->spec().owner == p.name,
                "a non-admin loaded another principal's checkpoint");
        if (target < 3) {
          Require((*s)->spec().owner == owner_of_id[target], "a restored session changed owner");
        }
        Require((*manager)->Close((*s)->id()).ok(), "Close the restored session");
        break;
      }
      case 4:    // OpenCheckpointDir (read), as ReadCheckpoint opens a path
      case 5:    // OpenCheckpointDir (create), as SaveCheckpoint opens its directory
      case 6: {  // SaveCheckpoint into a directory the caller names
        std::string path = payload;
        const bool local_admin = p.local && p.admin;
        absl::Status allowed = diond::rpc::CheckPathAllowed(p, path, "directory");
        if (!allowed.ok()) {
          RequireBounded(allowed, sent);
          Require(allowed.code() == absl::StatusCode::kPermissionDenied,
                  "a refused path is not PERMISSION_DENIED");
          Require(!local_admin, "a local admin's path was refused");
          break;
        }
        // A local admin may name any path: the harness lets it name only absolute paths inside
        // its own folder without "..", so that the fuzzer never creates directories elsewhere.
        if (!path.empty() && path[0] == '/') {
          if (!local_admin) break;  // CheckPathAllowed let it through: caught above
          if (absl::StrContains(path, "..") || !absl::StartsWith(path, g_root + "/")) break;
        }
        const bool confined = !local_admin || path.empty() || path[0] != '/' ||
                              path == g_state_dir || absl::StartsWith(path, g_state_dir + "/");
        if (kind % 8 == 6) {
          if (!confined) break;  // a local admin writing outside: allowed, not the property
          auto r = (*manager)->SaveCheckpoint(ids[target % 3], path);
          if (!r.ok()) {
            RequireBounded(r.status(), sent);
          } else {
            Require(path.find('\0') == std::string::npos, "a path with a NUL byte was used");
            std::error_code ec;
            const std::string real = fs::canonical(r->first, ec).string();
            Require(!ec && absl::StartsWith(real, g_state_real + "/"),
                    "a checkpoint was written outside the state dir");
          }
          break;
        }
        auto dir = diond::checkpoint::OpenCheckpointDir(g_state_dir, path, kind % 8 == 5);
        if (!dir.ok()) {
          RequireBounded(dir.status(), sent);
          break;
        }
        Require(path.find('\0') == std::string::npos,
                "a path with a NUL byte opened another directory than the one named");
        if (confined)
          Require(BeneathState(dir->fd()), "a path opened a directory outside the state dir");
        break;
      }
      default:
        break;
    }
    if (!p.local || !p.admin) {
      Require(Tree(g_outside) == outside_before,
              "something was created outside the state dir for a caller that is no local admin");
    } else {
      outside_before = Tree(g_outside);  // a local admin may create directories anywhere
    }
  }
  return 0;
}
