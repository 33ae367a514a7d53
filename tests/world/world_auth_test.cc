// The authenticated world (docs/OPERATIONS.md "Security"), against real daemons on loopback:
// rank 0's Peer service refuses callers without the world secret; with it, a fake rank still
// cannot take over a live rank (the Join proof), forge heartbeats for a dead one, store data past
// the quotas or register a huge address.
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "diond/v1/peer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

std::vector<std::string> WorldFlags(int rank, int coordinator_port) {
  std::vector<std::string> f = {
      "--world_size=2",    absl::StrCat("--rank=", rank),   "--heartbeat_interval=200ms",
      "--peer_timeout=2s", "--world_max_value_bytes=65536", "--world_max_keys=1000"};
  if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port));
  return f;
}

std::unique_ptr<grpc::ClientContext> PeerCtx(const std::string& secret) {
  auto ctx = Ctx();
  if (!secret.empty()) ctx->AddMetadata("x-diond-world-secret", secret);
  return ctx;
}

class WorldAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d0_ = Daemon::Start(WorldFlags(0, 0), /*tcp=*/true);
    ASSERT_NE(d0_, nullptr);
    d1_ = Daemon::Start(WorldFlags(1, d0_->tcp_port()), /*tcp=*/true);
    ASSERT_NE(d1_, nullptr);
    peer_ = v1::Peer::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", d0_->tcp_port()),
                                                  grpc::InsecureChannelCredentials()));
  }

  v1::Membership Membership() {
    v1::GetMembershipRequest req;
    v1::GetMembershipResponse resp;
    grpc::Status s = peer_->GetMembership(PeerCtx(kWorldSecret).get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.membership();
  }

  std::unique_ptr<Daemon> d0_, d1_;
  std::unique_ptr<v1::Peer::Stub> peer_;
};

TEST_F(WorldAuthTest, StrangersWithoutTheSecretAreRefusedOnEveryPeerRpc) {
  for (const std::string& secret : {std::string(), std::string("a-wrong-world-secret-0123")}) {
    SCOPED_TRACE(secret.empty() ? "no secret" : "wrong secret");
    v1::PeerSetRequest set;
    set.set_key("world/evil");
    set.set_value("x");
    v1::PeerSetResponse set_resp;
    EXPECT_EQ(peer_->Set(PeerCtx(secret).get(), set, &set_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::PeerGetRequest get;
    get.set_key("world/evil");
    v1::PeerGetResponse get_resp;
    EXPECT_EQ(peer_->Get(PeerCtx(secret).get(), get, &get_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::PeerWaitRequest wait;
    wait.add_keys("world/evil");
    v1::PeerWaitResponse wait_resp;
    EXPECT_EQ(peer_->Wait(PeerCtx(secret).get(), wait, &wait_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::JoinRequest join;
    join.set_rank(1);
    join.set_world_size(2);
    join.set_address("evil.example");
    join.set_incarnation(42);
    join.set_proof(std::string(32, 'x'));
    v1::JoinResponse join_resp;
    EXPECT_EQ(peer_->Join(PeerCtx(secret).get(), join, &join_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::HeartbeatRequest hb;
    hb.set_rank(1);
    hb.set_incarnation(42);
    v1::HeartbeatResponse hb_resp;
    EXPECT_EQ(peer_->Heartbeat(PeerCtx(secret).get(), hb, &hb_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::GetMembershipRequest gm;
    v1::GetMembershipResponse gm_resp;
    EXPECT_EQ(peer_->GetMembership(PeerCtx(secret).get(), gm, &gm_resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // The Unix socket is no way around it.
  auto local = v1::Peer::NewStub(
      grpc::CreateChannel("unix:" + d0_->dir() + "/d.sock", grpc::InsecureChannelCredentials()));
  v1::GetMembershipRequest gm;
  v1::GetMembershipResponse gm_resp;
  EXPECT_EQ(local->GetMembership(PeerCtx("").get(), gm, &gm_resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  const v1::Membership m = Membership();
  EXPECT_TRUE(m.complete());
  for (const auto& member : m.members()) EXPECT_EQ(member.address(), "127.0.0.1");
}

// With the secret (a member gone rogue, or a leaked secret): the live rank 1 cannot be replaced
// or impersonated, since its Join proof never leaves the process.
TEST_F(WorldAuthTest, AFakeRankCannotJoinOverALiveRankOrForgeItsHeartbeats) {
  const v1::Membership before = Membership();
  ASSERT_TRUE(before.complete());
  ASSERT_EQ(before.members_size(), 2);
  const uint64_t incarnation = before.members(1).incarnation();  // public in the view
  v1::JoinRequest join;
  join.set_rank(1);
  join.set_world_size(2);
  join.set_address("evil.example");
  join.set_incarnation(incarnation);
  join.set_proof(std::string(32, 'x'));
  v1::JoinResponse join_resp;
  EXPECT_EQ(peer_->Join(PeerCtx(kWorldSecret).get(), join, &join_resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  join.set_incarnation(incarnation + 1);  // a "new process" while rank 1 lives
  EXPECT_EQ(peer_->Join(PeerCtx(kWorldSecret).get(), join, &join_resp).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  v1::HeartbeatRequest hb;
  hb.set_rank(1);
  hb.set_incarnation(incarnation);
  hb.set_proof(std::string(32, 'x'));
  v1::HeartbeatResponse hb_resp;
  EXPECT_EQ(peer_->Heartbeat(PeerCtx(kWorldSecret).get(), hb, &hb_resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  const v1::Membership after = Membership();
  EXPECT_EQ(after.generation(), before.generation());
  EXPECT_EQ(after.members(1).address(), "127.0.0.1");
  EXPECT_EQ(after.members(1).incarnation(), incarnation);

  // SIGKILL rank 1 and forge its heartbeats: it is declared lost all the same.
  d1_->Kill();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  bool lost = false;
  while (absl::Now() < deadline && !lost) {
    v1::HeartbeatResponse r;
    peer_->Heartbeat(PeerCtx(kWorldSecret).get(), hb, &r);
    const v1::Membership m = Membership();
    lost = m.members_size() == 2 && !m.members(1).live();
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(lost) << "forged heartbeats kept a SIGKILLed rank alive";
  EXPECT_TRUE(d0_->Serving());
}

TEST_F(WorldAuthTest, QuotasAndAddressBoundsHoldForMembersToo) {
  // Found 2: 8 MiB values; here the limit is 64 KiB (--world_max_value_bytes).
  v1::PeerSetRequest set;
  set.set_key("world/big");
  set.set_value(std::string(8 << 20, 'v'));
  v1::PeerSetResponse set_resp;
  grpc::Status s = peer_->Set(PeerCtx(kWorldSecret).get(), set, &set_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--world_max_value_bytes")) << s.error_message();
  v1::PeerGetRequest get;
  get.set_key("world/big");
  v1::PeerGetResponse get_resp;
  EXPECT_EQ(peer_->Get(PeerCtx(kWorldSecret).get(), get, &get_resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Key count (--world_max_keys=1000): the 1000th new key at the latest is refused.
  grpc::Status last;
  int stored = 0;
  for (int i = 0; i < 1001 && last.ok(); ++i) {
    set.set_key(absl::StrCat("world/many/", i));
    set.set_value("1");
    last = peer_->Set(PeerCtx(kWorldSecret).get(), set, &set_resp);
    if (last.ok()) ++stored;
  }
  EXPECT_EQ(last.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(last.error_message(), "--world_max_keys")) << last.error_message();
  EXPECT_LE(stored, 1000);
  // Found 2: a 3 MiB address.
  v1::JoinRequest join;
  join.set_rank(1);
  join.set_world_size(2);
  join.set_address(std::string(3 << 20, 'a'));
  join.set_incarnation(7);
  join.set_proof(std::string(32, 'x'));
  v1::JoinResponse join_resp;
  grpc::Status j = peer_->Join(PeerCtx(kWorldSecret).get(), join, &join_resp);
  EXPECT_EQ(j.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(j.error_message().size(), 300u);
  const v1::Membership view = Membership();
  for (const auto& m : view.members()) EXPECT_LT(m.address().size(), 256u);
  EXPECT_TRUE(d0_->Serving());
}

// Mutual TLS instead of a secret: the daemons present certificates of the world's CA to rank 0
// (made here with openssl), and a caller without one is refused.
TEST(WorldTlsTest, MutualTlsWorldFormsWithoutASecret) {
  const std::string pki = testing::MakeTempDir("diond_world_pki");
  auto [rc, out] = testing::RunCommand(absl::StrCat(
      "set -e; cd ", pki, "; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "-subj /CN=world-ca 2>/dev/null; ",
      "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; ",
      "for n in d0 d1; do openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr "
      "-subj /CN=$n 2>/dev/null; openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -days 1 -extfile san.ext -out $n.pem 2>/dev/null; done"));
  ASSERT_EQ(rc, 0) << out;
  auto tls = [&pki](const std::string& n) {
    return std::vector<std::string>{"--tls_cert=" + pki + "/" + n + ".pem",
                                    "--tls_key=" + pki + "/" + n + ".key",
                                    "--tls_client_ca=" + pki + "/ca.pem", "--world_secret_file="};
  };
  std::vector<std::string> f0 = WorldFlags(0, 0), t0 = tls("d0");
  f0.insert(f0.end(), t0.begin(), t0.end());
  auto d0 = Daemon::Start(f0, /*tcp=*/true);
  ASSERT_NE(d0, nullptr);
  std::vector<std::string> f1 = WorldFlags(1, d0->tcp_port()), t1 = tls("d1");
  f1.insert(f1.end(), t1.begin(), t1.end());
  auto d1 = Daemon::Start(f1, /*tcp=*/true);  // ready = joined through TLS
  ASSERT_NE(d1, nullptr) << d0->Log();

  const std::string target = absl::StrCat("127.0.0.1:", d0->tcp_port());
  auto stub = [&](bool cert) {
    grpc::SslCredentialsOptions so;
    so.pem_root_certs = testing::ReadFile(pki + "/ca.pem");
    if (cert) {
      so.pem_cert_chain = testing::ReadFile(pki + "/d1.pem");
      so.pem_private_key = testing::ReadFile(pki + "/d1.key");
    }
    return v1::Peer::NewStub(grpc::CreateChannel(target, grpc::SslCredentials(so)));
  };
  v1::GetMembershipRequest req;
  v1::GetMembershipResponse resp;
  grpc::Status s = stub(true)->GetMembership(Ctx().get(), req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.membership().members_size(), 2);
  EXPECT_EQ(stub(false)->GetMembership(Ctx().get(), req, &resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  testing::RunCommand("rm -rf '" + pki + "'");
}

}  // namespace
}  // namespace diond::service_testing
