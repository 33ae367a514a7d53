#include "common/safetensors.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace diond {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Builds a file image from a raw header text and data bytes.
std::string Image(const std::string& header, const std::string& data) {
  std::string out;
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + data;
}

std::string FloatBytes(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), 4 * v.size());
}

TEST(SafetensorsTest, RoundTrip) {
  SafetensorsWriter w;
  w.SetMetadata("algorithm", "muon");
  ASSERT_THAT(w.AddF32("b", {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}), IsOk());
  ASSERT_THAT(w.AddF32("a.scalar", {}, std::vector<float>{7.5f}), IsOk());
  ASSERT_THAT(w.AddF32("empty", {0, 4}, std::vector<float>{}), IsOk());
  const std::string image = w.Serialize();
  EXPECT_EQ((image.size() - 8 - 24 - 4) % 8, 0u);  // header padded to a multiple of 8
  auto f = SafetensorsFile::Parse(image, "mem");
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ(f->metadata().at("algorithm"), "muon");
  ASSERT_EQ(f->tensors().size(), 3u);
  auto b = f->ReadFloat("b", std::vector<int64_t>{2, 3});
  ASSERT_THAT(b, IsOk());
  EXPECT_THAT(*b, ElementsAre(1, 2, 3, 4, 5, 6));
  auto s = f->ReadFloat("a.scalar");
  ASSERT_THAT(s, IsOk());
  EXPECT_THAT(*s, ElementsAre(7.5f));
  EXPECT_THAT(f->ReadFloat("b", std::vector<int64_t>{3, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'b'")));
  EXPECT_THAT(f->ReadFloat("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
}

TEST(SafetensorsTest, WriteAndReadFile) {
  const std::string path = ::testing::TempDir() + "/safetensors_test.safetensors";
  SafetensorsWriter w;
  ASSERT_THAT(w.AddF32("x", {3}, std::vector<float>{-1, 0.5f, 2}), IsOk());
  ASSERT_THAT(w.WriteFile(path), IsOk());
  auto f = SafetensorsFile::ReadFile(path);
  ASSERT_THAT(f, IsOk());
  EXPECT_THAT(*f->ReadFloat("x"), ElementsAre(-1, 0.5f, 2));
  std::remove(path.c_str());
  EXPECT_THAT(SafetensorsFile::ReadFile(path), StatusIs(absl::StatusCode::kNotFound));
}

TEST(SafetensorsTest, ConvertsOtherDtypes) {
  // BF16 1.0 = 0x3f80, F16 1.5 = 0x3e00, F16 subnormal 2^-24 = 0x0001, F64 0.1.
  std::string data;
  const uint16_t bf[2] = {0x3f80, 0xc000};  // 1, -2
  const uint16_t hf[2] = {0x3e00, 0x0001};
  const double d = 0.1;
  data.append(reinterpret_cast<const char*>(bf), 4);
  data.append(reinterpret_cast<const char*>(hf), 4);
  data.append(reinterpret_cast<const char*>(&d), 8);
  const std::string header = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                             R"("h":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},)"
                             R"("d":{"dtype":"F64","shape":[],"data_offsets":[8,16]}})";
  auto f = SafetensorsFile::Parse(Image(header, data), "mem");
  ASSERT_THAT(f, IsOk());
  EXPECT_THAT(*f->ReadFloat("a"), ElementsAre(1.0f, -2.0f));
  EXPECT_THAT(*f->ReadFloat("h"), ElementsAre(1.5f, 5.9604644775390625e-08f));
  EXPECT_THAT(*f->ReadFloat("d"), ElementsAre(0.1f));
}

struct BadCase {
  const char* name;
  std::string image;
  const char* message;  // substring expected in the error
};

std::vector<BadCase> BadCases() {
  const std::string ok_data = FloatBytes({1, 2});
  const std::string t = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::vector<BadCase> cases;
  cases.push_back({"short", std::string("\x05\x00\x00", 3), "truncated"});
  cases.push_back({"header_past_end", Image(t, ok_data).substr(0, 20), "truncated"});
  {
    std::string huge(8, '\xff');
    cases.push_back({"absurd_length", huge + "{}", "exceeds the limit"});
  }
  cases.push_back({"bad_json", Image("{\"t\": [1,", ok_data), "not valid JSON"});
  cases.push_back({"not_object", Image("[1,2]", ""), "not a JSON object"});
  cases.push_back({"deep", Image(std::string(50, '[') + std::string(50, ']'), ""), "nested"});
  cases.push_back({"data_truncated", Image(t, ok_data.substr(0, 6)), "'t'"});
  cases.push_back({"trailing_bytes", Image(t, ok_data + "xx"), "cover"});
  cases.push_back({"size_mismatch",
                   Image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", ok_data),
                   "'t'"});
  cases.push_back({"reversed",
                   Image(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", ok_data),
                   "reversed"});
  cases.push_back({"overlap",
                   Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         ok_data),
                   "overlap"});
  cases.push_back(
      {"gap", Image(R"({"u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", ok_data), "gap"});
  cases.push_back({"bad_dtype",
                   Image(R"({"t":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", ok_data),
                   "I32"});
  cases.push_back({"negative_dim",
                   Image(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", ok_data),
                   "negative"});
  cases.push_back({"float_offset",
                   Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})", ok_data),
                   "data_offsets"});
  cases.push_back(
      {"no_shape", Image(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", ok_data), "shape"});
  cases.push_back(
      {"overflow",
       Image(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})",
             ok_data),
       "overflow"});
  cases.push_back(
      {"metadata_not_string", Image(R"({"__metadata__":{"T":6}})", ""), "__metadata__"});
  cases.push_back({"entry_not_object", Image(R"({"t":5})", ""), "'t'"});
  return cases;
}

TEST(SafetensorsTest, MalformedInputsAreDataLoss) {
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.name);
    auto f = SafetensorsFile::Parse(c.image, "bad.safetensors");
    EXPECT_THAT(f, StatusIs(absl::StatusCode::kDataLoss, HasSubstr(c.message)));
    EXPECT_THAT(f, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad.safetensors")));
  }
}

TEST(SafetensorsTest, EveryTruncationOfAValidFileIsRejected) {
  SafetensorsWriter w;
  w.SetMetadata("k", "v");
  ASSERT_THAT(w.AddF32("x", {2, 2}, std::vector<float>{1, 2, 3, 4}), IsOk());
  const std::string image = w.Serialize();
  for (size_t len = 0; len < image.size(); ++len) {
    EXPECT_THAT(SafetensorsFile::Parse(image.substr(0, len), "cut"),
                StatusIs(absl::StatusCode::kDataLoss))
        << "length " << len;
  }
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  SafetensorsWriter w;
  EXPECT_THAT(w.AddF32("x", {2, 2}, std::vector<float>{1, 2, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'x'")));
  EXPECT_THAT(w.AddF32("__metadata__", {1}, std::vector<float>{1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(w.AddF32("y", {-1}, std::vector<float>{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(w.AddF32("z", {1}, std::vector<float>{1}), IsOk());
  EXPECT_THAT(w.AddF32("z", {1}, std::vector<float>{1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
}

}  // namespace
}  // namespace diond
