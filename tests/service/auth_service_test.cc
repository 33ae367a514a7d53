// Authentication and session ownership against the real daemon (docs/OPERATIONS.md "Security"): a
// foreign uid on the Unix socket, a wrong, missing or foreign bearer token over TCP, and foreign
// or missing TLS client certificates are refused on every RPC that names a session; ListSessions
// shows a caller its own sessions only; admins (root on the socket, an admin token) see and use
// all. The clients are auth_probe processes (another uid via setresuid, their own credentials).
// Certificates are made at test time with the openssl command.
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

constexpr char kAlice[] = "alice-token-0123456789abcdef";
constexpr char kBob[] = "bob-token-0123456789abcdefgh";
constexpr char kOps[] = "ops-admin-token-0123456789ab";
constexpr int kNobody = 65534;
constexpr int kOther = 65533;

// Every RPC that names a session (auth_probe's "all").
const std::vector<std::string> kSessionRpcs = {
    "RegisterRegion",     "UnregisterRegion", "PushGradients", "Step",           "PullParameters",
    "SetHyperparameters", "GetState",         "SetState",      "SaveCheckpoint", "CloseSession"};

struct ProbeResult {
  int rc = -1;
  std::vector<std::string> lines;
  std::map<std::string, std::string> codes;  // "<Rpc>" -> code
  std::string Text() const { return absl::StrJoin(lines, "\n"); }
  // The last line, or "" when the probe printed nothing (e.g. it died: never lines.back() then).
  std::string last() const { return lines.empty() ? "" : lines.back(); }
  std::string session() const {
    for (const auto& l : lines) {
      if (absl::StartsWith(l, "session ")) return l.substr(8);
    }
    return "";
  }
  std::vector<std::string> Listed() const {  // "<id> <owner>"
    std::vector<std::string> out;
    for (const auto& l : lines) {
      if (absl::StartsWith(l, "listed ")) out.push_back(l.substr(7));
    }
    return out;
  }
};

struct Creds {
  int uid = -1;
  std::string token;
  std::string tls_ca, tls_cert, tls_key;  // files
};

Creds Uid(int uid) {
  Creds c;
  c.uid = uid;
  return c;
}
Creds Token(const std::string& token) {
  Creds c;
  c.token = token;
  return c;
}

class AuthTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags = {}) {
    dir_ = testing::MakeTempDir("diond_auth");
    tokens_ = dir_ + "/tokens";
    std::ofstream(tokens_) << "# principals of the test\n"
                           << kAlice << " alice\n"
                           << kBob << "\tbob\n\n"
                           << kOps << " ops admin\n";
    flags.push_back("--auth_token_file=" + tokens_);
    flags.push_back("--state_dir=" + dir_ + "/state");
    daemon_ = Daemon::Start(flags, /*tcp=*/true);
    ASSERT_NE(daemon_, nullptr);
    // Let other uids reach the socket (it is 0600 in a 0700 directory): the daemon, not the
    // file mode, must tell them apart.
    chmod(daemon_->dir().c_str(), 0755);
    chmod((daemon_->dir() + "/d.sock").c_str(), 0666);
  }

  std::string Unix() const { return "unix:" + daemon_->dir() + "/d.sock"; }
  std::string Tcp() const { return absl::StrCat("127.0.0.1:", daemon_->tcp_port()); }

  ProbeResult Probe(const std::string& target, const Creds& c,
                    const std::vector<std::string>& cmd) {
    std::vector<std::string> argv = {AUTH_PROBE, "--target=" + target};
    if (c.uid >= 0) argv.push_back(absl::StrCat("--uid=", c.uid));
    if (!c.token.empty()) argv.push_back("--token=" + c.token);
    if (!c.tls_ca.empty()) argv.push_back("--tls_ca=" + c.tls_ca);
    if (!c.tls_cert.empty()) {
      argv.push_back("--tls_cert=" + c.tls_cert);
      argv.push_back("--tls_key=" + c.tls_key);
    }
    argv.insert(argv.end(), cmd.begin(), cmd.end());
    const std::string log = absl::StrCat(dir_, "/probe-", ++probes_, ".txt");
    testing::Subprocess p(argv, log);
    ProbeResult r;
    auto rc = p.Wait(absl::Seconds(120));
    r.rc = rc.value_or(-100);
    for (absl::string_view l : absl::StrSplit(p.Log(), '\n', absl::SkipEmpty())) {
      // gRPC may log to stderr too: keep the probe's own lines.
      std::vector<std::string> f = absl::StrSplit(l, ' ');
      if (f.size() == 2 && f[1] == absl::AsciiStrToUpper(f[1])) r.codes[f[0]] = f[1];
      r.lines.emplace_back(l);
    }
    return r;
  }

  // Every session RPC of `r` answered `code`.
  void ExpectAll(const ProbeResult& r, const std::string& code, const std::string& who) {
    for (const auto& rpc : kSessionRpcs) {
      auto it = r.codes.find(rpc);
      ASSERT_NE(it, r.codes.end()) << who << ": no answer for " << rpc << ":\n" << r.Text();
      EXPECT_EQ(it->second, code) << who << " " << rpc << ":\n" << r.Text();
    }
  }

  // The session's parameters and its presence, as the (admin) test process sees them.
  std::string Fingerprint(const std::string& id) {
    TensorMap m;
    grpc::Status s = PullParameters(daemon_->stub(), id, &m);
    EXPECT_TRUE(s.ok()) << s.error_message();
    TensorMap state;
    grpc::Status g = GetState(daemon_->stub(), id, false, &state);
    EXPECT_TRUE(g.ok()) << g.error_message();
    std::string all = m["w"];
    for (const auto& [n, b] : state) absl::StrAppend(&all, n, b);
    return all;
  }

  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Kill();
    for (const std::string& d : {dir_, pki_}) {
      if (absl::StartsWith(d, "/tmp/diond_")) testing::RunCommand("rm -rf '" + d + "'");
    }
  }

  std::string dir_, tokens_, pki_;
  int probes_ = 0;
  std::unique_ptr<Daemon> daemon_;
};

// Over the Unix socket another local user can neither see, read, change, step nor close a session;
// over TCP neither without a token, with a wrong one, nor with another principal's token. Admins
// can.
TEST_F(AuthTest, UnixUidsOwnTheirSessionsAndEveryoneElseIsRefused) {
  StartDaemon();
  ProbeResult created = Probe(Unix(), Uid(kNobody), {"create"});
  const std::string id = created.session();
  ASSERT_FALSE(id.empty()) << created.Text();

  ProbeResult own = Probe(Unix(), Uid(kNobody), {"list"});
  ASSERT_EQ(own.Listed(), std::vector<std::string>{id + " uid:65534"}) << own.Text();

  const std::string before = Fingerprint(id);
  ExpectAll(Probe(Unix(), Uid(kOther), {"all", id}), "PERMISSION_DENIED", "uid 65533");
  ExpectAll(Probe(Tcp(), Token(kBob), {"all", id}), "PERMISSION_DENIED", "bob's token");
  ExpectAll(Probe(Tcp(), Creds(), {"all", id}), "UNAUTHENTICATED", "no token");
  ExpectAll(Probe(Tcp(), Token("not-a-token-of-this-daemon"), {"all", id}), "UNAUTHENTICATED",
            "a wrong token");
  // Nothing changed: parameters, state, and the session is still there.
  EXPECT_EQ(Fingerprint(id), before);

  EXPECT_EQ(Probe(Unix(), Uid(kOther), {"list"}).last(), "count 0");
  EXPECT_EQ(Probe(Tcp(), Token(kBob), {"list"}).last(), "count 0");
  ProbeResult anonymous = Probe(Tcp(), Creds(), {"list"});
  EXPECT_EQ(anonymous.codes["ListSessions"], "UNAUTHENTICATED") << anonymous.Text();
  ProbeResult wrong = Probe(Tcp(), Creds(), {"create"});
  EXPECT_EQ(wrong.codes["CreateSession"], "UNAUTHENTICATED") << wrong.Text();

  // Admins: root on the socket (this process) and the ops token.
  v1::ListSessionsResponse all;
  ASSERT_TRUE(daemon_->stub().ListSessions(Ctx().get(), {}, &all).ok());
  ASSERT_EQ(all.sessions_size(), 1);
  EXPECT_EQ(all.sessions(0).owner(), "uid:65534");
  ProbeResult ops = Probe(Tcp(), Token(kOps), {"list"});
  EXPECT_EQ(ops.Listed(), std::vector<std::string>{id + " uid:65534"}) << ops.Text();
  ProbeResult pulled = Probe(Tcp(), Token(kOps), {"pull", id});
  EXPECT_TRUE(absl::StartsWith(pulled.last(), "pull OK")) << pulled.Text();

  // The owner itself passes the gate on every RPC (the calls may fail for other reasons: the
  // probe sends NaN state and an unknown segment), and its CloseSession closes the session.
  ProbeResult owner = Probe(Unix(), Uid(kNobody), {"all", id});
  for (const auto& rpc : kSessionRpcs) {
    EXPECT_NE(owner.codes[rpc], "PERMISSION_DENIED") << rpc << ":\n" << owner.Text();
    EXPECT_NE(owner.codes[rpc], "UNAUTHENTICATED") << rpc;
  }
  EXPECT_EQ(owner.codes["CloseSession"], "OK") << owner.Text();
  EXPECT_TRUE(daemon_->Serving());
}

// Tokens name principals: each sees and uses its own sessions; the admin token sees all.
TEST_F(AuthTest, BearerTokensOverTcpSeparatePrincipals) {
  StartDaemon();
  const std::string a = Probe(Tcp(), Token(kAlice), {"create"}).session();
  const std::string b = Probe(Tcp(), Token(kBob), {"create"}).session();
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(Probe(Tcp(), Token(kAlice), {"list"}).Listed(), std::vector<std::string>{a + " alice"});
  EXPECT_EQ(Probe(Tcp(), Token(kBob), {"list"}).Listed(), std::vector<std::string>{b + " bob"});
  EXPECT_EQ(Probe(Tcp(), Token(kOps), {"list"}).last(), "count 2");
  // A uid on the socket is another principal than a token.
  EXPECT_EQ(Probe(Unix(), Uid(kNobody), {"list"}).last(), "count 0");
  const std::string before = Fingerprint(a);
  ExpectAll(Probe(Tcp(), Token(kBob), {"all", a}), "PERMISSION_DENIED", "bob on alice's");
  ExpectAll(Probe(Unix(), Uid(kNobody), {"all", a}), "PERMISSION_DENIED", "uid 65534 on alice's");
  EXPECT_EQ(Fingerprint(a), before);
  EXPECT_TRUE(absl::StartsWith(Probe(Tcp(), Token(kOps), {"pull", a}).last(), "pull OK"));
  EXPECT_TRUE(absl::StartsWith(Probe(Tcp(), Token(kAlice), {"pull", a}).last(), "pull OK"));
}

// A local user may register only shm segments its uid owns (the daemon, root here, could open
// anybody's).
TEST_F(AuthTest, ALocalUserCannotRegisterAnotherUsersSegment) {
  StartDaemon();
  const std::string id = Probe(Unix(), Uid(kNobody), {"create"}).session();
  ASSERT_FALSE(id.empty());
  auto seg = ShmSegment::Create(4096);  // owned by root
  ASSERT_NE(seg, nullptr);
  ProbeResult r = Probe(Unix(), Uid(kNobody), {"register", id, seg->name()});
  EXPECT_EQ(r.codes["register"], "PERMISSION_DENIED") << r.Text();
  // Once the segment belongs to the caller, the ownership check passes.
  ASSERT_EQ(chown(("/dev/shm/" + seg->name()).c_str(), kNobody, kNobody), 0);
  r = Probe(Unix(), Uid(kNobody), {"register", id, seg->name()});
  EXPECT_NE(r.codes["register"], "PERMISSION_DENIED") << r.Text();
}

// --allow_unauthenticated_tcp: TCP callers without a credential are one principal, "anonymous",
// which still cannot touch other principals' sessions.
TEST_F(AuthTest, AllowUnauthenticatedTcpMakesAnonymousAPrincipal) {
  StartDaemon({"--allow_unauthenticated_tcp"});
  const std::string mine = Probe(Unix(), Uid(kNobody), {"create"}).session();
  const std::string anon = Probe(Tcp(), Creds(), {"create"}).session();
  ASSERT_FALSE(anon.empty());
  EXPECT_EQ(Probe(Tcp(), Creds(), {"list"}).Listed(),
            std::vector<std::string>{anon + " anonymous"});
  ExpectAll(Probe(Tcp(), Creds(), {"all", mine}), "PERMISSION_DENIED", "anonymous");
  // A presented token is still checked.
  ExpectAll(Probe(Tcp(), Token("not-a-token-of-this-daemon"), {"all", anon}), "UNAUTHENTICATED",
            "a wrong token");
}

// ---- TLS -----------------------------------------------------------------------------------

class TlsAuthTest : public AuthTest {
 protected:
  // A CA, the daemon's certificate for 127.0.0.1 and two client certificates, by openssl.
  bool MakeCertificates() {
    pki_ = testing::MakeTempDir("diond_pki");
    const std::string script = absl::StrCat(
        "set -e; cd ", pki_, "; ",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
        "-subj /CN=diond-test-ca 2>/dev/null; ",
        "for n in server trainer-1 trainer-2; do "
        "openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr -subj /CN=$n "
        "2>/dev/null; done; ",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext; ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile san.ext -out server.pem 2>/dev/null; ",
        "for n in trainer-1 trainer-2; do openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -days 1 -out $n.pem 2>/dev/null; done; ",
        // A client certificate from a CA the daemon does not trust.
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout rogue.key -out rogue.pem -days 1 "
        "-subj /CN=trainer-1 2>/dev/null; chmod 0644 *");
    auto [rc, out] = testing::RunCommand(script);
    return rc == 0;
  }
  Creds Cert(const std::string& name, const std::string& token = "") const {
    Creds c;
    c.token = token;
    c.tls_ca = pki_ + "/ca.pem";
    if (!name.empty()) {
      c.tls_cert = absl::StrCat(pki_, "/", name, ".pem");
      c.tls_key = absl::StrCat(pki_, "/", name, ".key");
    }
    return c;
  }
};

TEST_F(TlsAuthTest, ClientCertificatesAndTokensOverTls) {
  ASSERT_TRUE(MakeCertificates());
  StartDaemon({"--tls_cert=" + pki_ + "/server.pem", "--tls_key=" + pki_ + "/server.key",
               "--tls_client_ca=" + pki_ + "/ca.pem"});
  ProbeResult created = Probe(Tcp(), Cert("trainer-1"), {"create"});
  const std::string id = created.session();
  ASSERT_FALSE(id.empty()) << created.Text();
  ProbeResult listed = Probe(Tcp(), Cert("trainer-1"), {"list"});
  ASSERT_EQ(listed.Listed().size(), 1u) << listed.Text();
  EXPECT_TRUE(absl::StartsWith(listed.Listed()[0], id + " x509:")) << listed.Text();
  EXPECT_TRUE(absl::StrContains(listed.Listed()[0], "CN=trainer-1")) << listed.Text();

  const std::string before = Fingerprint(id);
  ExpectAll(Probe(Tcp(), Cert("trainer-2"), {"all", id}), "PERMISSION_DENIED", "trainer-2");
  ExpectAll(Probe(Tcp(), Cert(""), {"all", id}), "UNAUTHENTICATED", "TLS without credential");
  ExpectAll(Probe(Tcp(), Cert("", kBob), {"all", id}), "PERMISSION_DENIED", "bob over TLS");
  // A certificate of an untrusted CA never gets through the handshake.
  ProbeResult rogue = Probe(Tcp(), Cert("rogue"), {"list"});
  EXPECT_EQ(rogue.codes["ListSessions"], "UNAVAILABLE") << rogue.Text();
  // Plaintext to the TLS port fails too.
  ProbeResult plain = Probe(Tcp(), Token(kOps), {"list"});
  EXPECT_EQ(plain.codes["ListSessions"], "UNAVAILABLE") << plain.Text();
  EXPECT_EQ(Fingerprint(id), before);

  EXPECT_EQ(Probe(Tcp(), Cert("", kOps), {"list"}).last(), "count 1");
  EXPECT_EQ(Probe(Tcp(), Cert("trainer-2"), {"list"}).last(), "count 0");
  ProbeResult closed = Probe(Tcp(), Cert("trainer-1"), {"all", id});
  EXPECT_EQ(closed.codes["CloseSession"], "OK") << closed.Text();
}

TEST_F(TlsAuthTest, ServerTlsWithoutClientCertificatesTakesTokens) {
  ASSERT_TRUE(MakeCertificates());
  StartDaemon({"--tls_cert=" + pki_ + "/server.pem", "--tls_key=" + pki_ + "/server.key"});
  const std::string id = Probe(Tcp(), Cert("", kAlice), {"create"}).session();
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(Probe(Tcp(), Cert("", kAlice), {"list"}).Listed(),
            std::vector<std::string>{id + " alice"});
  // Without --tls_client_ca a certificate is no credential.
  ExpectAll(Probe(Tcp(), Cert("trainer-1"), {"all", id}), "UNAUTHENTICATED", "cert only");
  ExpectAll(Probe(Tcp(), Cert("", kBob), {"all", id}), "PERMISSION_DENIED", "bob");
}

}  // namespace
}  // namespace diond::service_testing
