#include "server/comm/memory_store.h"

#include <atomic>
#include <thread>

#include "common/status_matchers.h"
#include "gloo/common/error.h"
#include "gtest/gtest.h"
#include "server/comm/gloo_store.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

TEST(MemoryKeyValueStore, SetGetOverwrite) {
  MemoryKeyValueStore s;
  EXPECT_THAT(s.Get("a").status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_THAT(s.Set("a", "1"), IsOk());
  ASSERT_THAT(s.Set("a", std::string("2\0x", 3)), IsOk());
  EXPECT_EQ(*s.Get("a"), std::string("2\0x", 3));
}

// Found by peer_fuzz: refusals echoed the key raw (a newline in it split the message).
TEST(MemoryKeyValueStore, RefusalsEchoTheKeyBoundedAndOnOneLine) {
  StoreLimits limits;
  limits.max_value_bytes = 4;
  limits.max_keys = 1;
  MemoryKeyValueStore store(limits);
  absl::Status big = store.Set("line\nbreak", "too long");
  EXPECT_THAT(big,
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("line?break")));
  ASSERT_THAT(store.Set("a", "v"), IsOk());
  absl::Status full = store.Set(std::string(300, 'k') + "\n", "v");
  EXPECT_THAT(full, StatusIs(absl::StatusCode::kResourceExhausted));
  for (const absl::Status& s : {big, full}) {
    EXPECT_EQ(std::string(s.message()).find('\n'), std::string::npos) << s;
    EXPECT_LT(s.message().size(), 400u) << s;
  }
  EXPECT_EQ(store.size(), 1u);
}

TEST(MemoryKeyValueStore, WaitReturnsWhenKeysArrive) {
  MemoryKeyValueStore s;
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_THAT(s.Set("x", "1"), IsOk());
    ASSERT_THAT(s.Set("y", "2"), IsOk());
  });
  EXPECT_THAT(s.Wait({"x", "y"}, absl::Seconds(5)), IsOk());
  t.join();
}

TEST(MemoryKeyValueStore, WaitTimesOutNamingMissingKeys) {
  MemoryKeyValueStore s;
  ASSERT_THAT(s.Set("x", "1"), IsOk());
  const absl::Time t0 = absl::Now();
  absl::Status st = s.Wait({"x", "nope"}, absl::Milliseconds(50));
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_NE(st.message().find("'nope'"), std::string::npos) << st;
  EXPECT_EQ(st.message().find("'x'"), std::string::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
}

TEST(MemoryKeyValueStore, WaitAsyncCompletesOnSetAndOnTimeout) {
  MemoryKeyValueStore s;
  std::atomic<int> ok{0}, late{0};
  s.WaitAsync({"k"}, absl::Seconds(10), [&](absl::Status st) { ok += st.ok() ? 1 : 100; });
  s.WaitAsync({"never"}, absl::Milliseconds(30),
              [&](absl::Status st) { late += absl::IsDeadlineExceeded(st) ? 1 : 100; });
  ASSERT_THAT(s.Set("k", "v"), IsOk());
  EXPECT_EQ(ok.load(), 1);
  for (int i = 0; i < 200 && late.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(late.load(), 1);
}

TEST(MemoryKeyValueStore, DeletePrefixRemovesOnlyThatGeneration) {
  MemoryKeyValueStore s;
  ASSERT_THAT(s.Set("world/a/g1/x", "1"), IsOk());
  ASSERT_THAT(s.Set("world/a/g10/x", "1"), IsOk());
  ASSERT_THAT(s.Set("world/a/g2/x", "1"), IsOk());
  s.DeletePrefix("world/a/g1/");
  EXPECT_THAT(s.Get("world/a/g1/x").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(s.Get("world/a/g10/x").status(), IsOk());
  EXPECT_THAT(s.Get("world/a/g2/x").status(), IsOk());
}

TEST(GlooStore, PrefixesIsolateGenerations) {
  MemoryKeyValueStore kv;
  GlooStore g1(&kv, "world/c/g1/gloo/", absl::Milliseconds(100));
  GlooStore g2(&kv, "world/c/g2/gloo/", absl::Milliseconds(100));
  g1.set("0", {'a', 'b'});
  EXPECT_EQ(g1.get("0"), (std::vector<char>{'a', 'b'}));
  EXPECT_EQ(*kv.Get("world/c/g1/gloo/0"), "ab");
  // The next generation does not see the old address: it times out (as an IoException, which
  // is what Gloo's rendezvous expects from a store).
  EXPECT_THROW(g2.get("0"), gloo::IoException);
  g2.set("0", {'c'});
  EXPECT_EQ(g2.get("0"), (std::vector<char>{'c'}));
  EXPECT_EQ(g1.get("0"), (std::vector<char>{'a', 'b'}));
}

TEST(GlooStore, WaitHonoursTheShorterTimeout) {
  MemoryKeyValueStore kv;
  GlooStore g(&kv, "p/", absl::Milliseconds(50));
  const absl::Time t0 = absl::Now();
  EXPECT_THROW(g.wait({"missing"}, std::chrono::seconds(30)), gloo::IoException);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(10));
    g.set("later", {'1'});
  });
  EXPECT_NO_THROW(g.wait({"later"}, std::chrono::seconds(5)));
  t.join();
}

// A caller must not fill rank 0's memory: unbounded values (100 x 8 MiB) are refused; nothing is
// stored past a quota.
TEST(MemoryKeyValueStore, QuotasRefuseOversizedKeysValuesAndTotals) {
  StoreLimits l;
  l.max_key_bytes = 64;
  l.max_value_bytes = 1000;
  l.max_keys = 3;
  l.max_bytes = 2000;
  MemoryKeyValueStore s(l);
  auto big_key = s.Set(std::string(65, 'k'), "v");
  EXPECT_THAT(big_key, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(big_key.message().find("--world_max_key_bytes"), std::string::npos) << big_key;
  auto big_value = s.Set("a", std::string(1001, 'v'));
  EXPECT_THAT(big_value, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(big_value.message().find("--world_max_value_bytes"), std::string::npos);
  ASSERT_THAT(s.Set("a", std::string(900, 'v')), IsOk());
  ASSERT_THAT(s.Set("b", std::string(900, 'v')), IsOk());
  auto total = s.Set("c", std::string(900, 'v'));
  EXPECT_THAT(total, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(total.message().find("--world_max_store_bytes"), std::string::npos) << total;
  EXPECT_EQ(s.bytes(), 2 + 1800);
  // Replacing a value counts its new size only.
  ASSERT_THAT(s.Set("b", std::string(10, 'v')), IsOk());
  EXPECT_EQ(s.bytes(), 2 + 910);
  ASSERT_THAT(s.Set("c", "1"), IsOk());
  auto count = s.Set("d", "1");
  EXPECT_THAT(count, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(count.message().find("--world_max_keys"), std::string::npos);
  EXPECT_EQ(s.size(), 3u);
  EXPECT_THAT(s.Get("d").status(), StatusIs(absl::StatusCode::kNotFound));
  s.DeletePrefix("");
  EXPECT_EQ(s.bytes(), 0);
  EXPECT_THAT(s.Set("d", "1"), IsOk());
}

}  // namespace
}  // namespace diond::comm
