#include "common/bounded.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace diond {
namespace {

TEST(Bounded, ShortValuesAreUnchanged) {
  EXPECT_EQ(Bounded("w.0/state"), "w.0/state");
  EXPECT_EQ(Bounded(std::string(kMaxEchoBytes, 'x')), std::string(kMaxEchoBytes, 'x'));
}

TEST(Bounded, LongValuesAreCutAndSayHowLongTheyWere) {
  const std::string big(1 << 20, 'a');
  const std::string b = Bounded(big);
  EXPECT_LT(b.size(), kMaxEchoBytes + 32);
  EXPECT_TRUE(absl::StartsWith(b, std::string(kMaxEchoBytes, 'a')));
  EXPECT_TRUE(absl::EndsWith(b, "\xe2\x80\xa6 (1048576 bytes)")) << b;
}

TEST(Bounded, DoesNotCutAUtf8Character) {
  // 199 ASCII bytes, then a 3-byte character straddling the 200-byte limit.
  std::string v(kMaxEchoBytes - 1, 'a');
  v += "\xe2\x82\xac";  // U+20AC
  v += std::string(50, 'b');
  const std::string b = Bounded(v);
  EXPECT_TRUE(absl::StartsWith(b, std::string(kMaxEchoBytes - 1, 'a') + "\xe2\x80\xa6")) << b;
}

TEST(Bounded, ControlCharactersAreMasked) {
  EXPECT_EQ(Bounded(std::string("a\nb\0c", 5)), "a?b?c");
}

TEST(BoundedList, ListsUpToTheLimitThenCounts) {
  EXPECT_EQ(BoundedList({3, 3}), "3,3");
  std::vector<int64_t> million(1000000, 1);
  const std::string b = BoundedList(million, 4);
  EXPECT_EQ(b, "1,1,1,1,\xe2\x80\xa6 (1000000 entries)");
}

TEST(BoundedMessage, CapsWholeMessages) {
  EXPECT_EQ(BoundedMessage("short"), "short");
  const std::string b = BoundedMessage(std::string(2 << 20, 'm'));
  EXPECT_LT(b.size(), kMaxStatusMessageBytes + 64);
  EXPECT_TRUE(absl::StrContains(b, "message of 2097152 bytes cut"));
}

}  // namespace
}  // namespace diond
