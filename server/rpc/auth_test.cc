#include "server/rpc/auth.h"

#include <fstream>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

TEST(ParseTokenFile, ReadsPrincipalsAndAdminsSkippingCommentsAndBlankLines) {
  auto t = ParseTokenFile(
      "# comment\n\n  tok-aaaaaaaaaaaaaaaa alice\ntok-bbbbbbbbbbbbbbbb\tops admin\r\n");
  ASSERT_THAT(t.status(), IsOk());
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].principal, "alice");
  EXPECT_FALSE((*t)[0].admin);
  EXPECT_EQ((*t)[1].principal, "ops");
  EXPECT_TRUE((*t)[1].admin);
  // Only digests are kept.
  EXPECT_EQ((*t)[0].digest.size(), 32u);
  EXPECT_EQ((*t)[0].digest.find("tok-"), std::string::npos);
}

TEST(ParseTokenFile, RefusesBadLinesNamingTheLineButNeverTheToken) {
  const std::string secret = "very-secret-token-value";
  for (const std::string& text : std::vector<std::string>{
           secret + "\n", secret + " alice root\n", "short alice\n", secret + " al/ice!\n",
           "# nothing\n", secret + " a\n" + secret + " b\n"}) {
    auto t = ParseTokenFile(text);
    EXPECT_THAT(t.status(), StatusIs(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_EQ(t.status().message().find(secret), std::string::npos) << t.status();
  }
  auto dup = ParseTokenFile("tok-aaaaaaaaaaaaaaaa a\n\ntok-aaaaaaaaaaaaaaaa b\n");
  EXPECT_NE(dup.status().message().find("line 3"), std::string::npos) << dup.status();
}

TEST(ConstantTimeEquals, ComparesContentsOfAnyLength) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(ReadSecretFile, StripsTrailingNewlinesAndBoundsTheSize) {
  const std::string path = ::testing::TempDir() + "/secret";
  std::ofstream(path) << "0123456789abcdef-secret\n\n";
  auto s = ReadSecretFile(path);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_EQ(*s, "0123456789abcdef-secret");
  std::ofstream(path, std::ios::trunc) << "short\n";
  EXPECT_THAT(ReadSecretFile(path).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  std::ofstream(path, std::ios::trunc) << std::string(5000, 'x');
  EXPECT_THAT(ReadSecretFile(path).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ReadSecretFile(path + ".missing").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(UnixPeers, MapsAcceptedFdPeersOnly) {
  UnixPeers p;
  p.Record(300, 1000, session::ProcessId{4242, 77});
  UnixPeer peer;
  EXPECT_TRUE(p.Lookup("fd:300", &peer));
  EXPECT_EQ(peer.uid, 1000u);
  EXPECT_EQ(peer.process, (session::ProcessId{4242, 77}));
  EXPECT_FALSE(p.Lookup("fd:301", &peer));
  EXPECT_FALSE(p.Lookup("ipv4:127.0.0.1:300", &peer));
  EXPECT_FALSE(p.Lookup("unix:/tmp/x", &peer));
}

// The orphan reaper watches the process of a Unix caller; TCP callers have none.
TEST(Authenticator, AUnixCallerCarriesItsProcessATcpCallerNone) {
  AuthOptions o;
  o.allow_unauthenticated_tcp = true;
  Authenticator auth(o);
  auth.unix_peers()->Record(300, 1000, session::ProcessId{4242, 77});
  CallCredentials unix_call;
  unix_call.peer = "fd:300";
  auto local = auth.Authenticate(unix_call);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(local->local);
  EXPECT_EQ(local->process, (session::ProcessId{4242, 77}));
  CallCredentials tcp_call;
  tcp_call.peer = "ipv4:127.0.0.1:5000";
  auto remote = auth.Authenticate(tcp_call);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_FALSE(remote->process.known());
}

}  // namespace
}  // namespace diond::rpc
