#include "common/strict_json.h"

#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace diond::strict_json {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

MATCHER_P(IsOkAndHolds, value, "is OK and holds " + ::testing::PrintToString(value)) {
  return arg.ok() && *arg == value;
}

Json Doc() {
  return Json::parse(R"({"s": "abc", "b": true, "i": -3, "u": 18446744073709551615,
                         "d": 0.5, "a": [1, 2, 3], "o": {"x": 1}})");
}

TEST(StrictJson, JsonDepthSkipsStringsAndStopsAtTheLimit) {
  EXPECT_EQ(JsonDepth("{\"a\": [1, {\"b\": []}]}", 32), 4);
  EXPECT_EQ(JsonDepth("{\"a\": \"[[[[{{{{\\\"[[[\"}", 32), 1);
  EXPECT_EQ(JsonDepth(std::string(1000000, '['), 32), 33);
  EXPECT_EQ(JsonDepth("", 32), 0);
}

TEST(StrictJson, EachGetterNamesTheFieldByItsPath) {
  const Json j = Doc();
  EXPECT_THAT(GetString(j, "s", "spec."), IsOkAndHolds("abc"));
  EXPECT_THAT(GetString(j, "missing", "spec."),
              StatusIs(absl::StatusCode::kDataLoss, "spec.missing: missing"));
  EXPECT_THAT(GetString(j, "i", "spec."),
              StatusIs(absl::StatusCode::kDataLoss, "spec.i: expected a string, got number"));
  EXPECT_THAT(GetString(j, "s", "", 2),
              StatusIs(absl::StatusCode::kDataLoss, "s: 3 bytes; at most 2"));
  EXPECT_THAT(GetBool(j, "b", ""), IsOkAndHolds(true));
  EXPECT_THAT(GetBool(j, "i", "g."),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("g.i: expected true or false")));
  EXPECT_THAT(GetArray(j, "a", "", 3), IsOk());
  EXPECT_THAT(GetArray(j, "a", "", 2),
              StatusIs(absl::StatusCode::kDataLoss, "a: 3 entries; at most 2"));
  EXPECT_THAT(GetArray(j, "o", "", 2),
              StatusIs(absl::StatusCode::kDataLoss, "o: expected an array, got object"));
}

TEST(StrictJson, IntegersAreRangeCheckedWithoutWrapping) {
  const Json j = Doc();
  EXPECT_THAT(GetInt(j, "i", "", -3, 0), IsOkAndHolds(-3));
  EXPECT_THAT(GetInt(j, "i", "", 0, 10),
              StatusIs(absl::StatusCode::kDataLoss, "i: -3 is out of range [0, 10]"));
  // 2^64 - 1 would be -1 as an int64_t, inside [-3, 0].
  EXPECT_THAT(GetInt(j, "u", "", -3, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("18446744073709551615 is out")));
  EXPECT_THAT(GetInt(j, "d", "", 0, 1),
              StatusIs(absl::StatusCode::kDataLoss, "d: expected an integer, got number"));
  EXPECT_THAT(IntValue(j["a"][1], "a[1]", 0, 1),
              StatusIs(absl::StatusCode::kDataLoss, "a[1]: 2 is out of range [0, 1]"));
}

TEST(StrictJson, NumbersAreFiniteAndAboveTheirBound) {
  const Json j = Doc();
  EXPECT_THAT(GetNumber(j, "d", ""), IsOkAndHolds(0.5));
  EXPECT_THAT(GetNumber(j, "i", ""), IsOkAndHolds(-3.0));
  EXPECT_THAT(GetNumber(j, "i", "", 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("i: -3 is out of range")));
  EXPECT_THAT(GetNumber(j, "s", ""),
              StatusIs(absl::StatusCode::kDataLoss, "s: expected a number, got string"));
}

}  // namespace
}  // namespace diond::strict_json
