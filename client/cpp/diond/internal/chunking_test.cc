#include "diond/internal/chunking.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace diond::client::internal {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

std::vector<v1::TensorChunk> Chunk(const std::vector<ConstTensorRef>& tensors, int64_t chunk) {
  std::vector<v1::TensorChunk> out;
  absl::Status s = ChunkTensors("sess", tensors, chunk, [&out](const v1::TensorChunk& c) {
    out.push_back(c);
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(ChunkTensors, SplitsEachTensorInOrderWithinTheLimit) {
  auto a = Bytes(10, 1), b = Bytes(3, 2);
  auto chunks = Chunk({{"a", a, DType::kF32}, {"b", b, std::nullopt}}, 4);
  // a: 4+4+2, b: 3.
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].session_id(), "sess");
  for (size_t i = 1; i < chunks.size(); ++i) EXPECT_EQ(chunks[i].session_id(), "");
  EXPECT_EQ(chunks[0].name(), "a");
  EXPECT_EQ(chunks[0].offset_bytes(), 0);
  EXPECT_EQ(chunks[0].total_bytes(), 10);
  EXPECT_EQ(chunks[0].dtype(), v1::DTYPE_F32);
  EXPECT_EQ(chunks[1].offset_bytes(), 4);
  EXPECT_EQ(chunks[1].total_bytes(), 0);  // only the first chunk of a tensor carries it
  EXPECT_EQ(chunks[2].offset_bytes(), 8);
  EXPECT_EQ(chunks[2].data().size(), 2u);
  EXPECT_EQ(chunks[3].name(), "b");
  EXPECT_EQ(chunks[3].total_bytes(), 3);
  EXPECT_EQ(chunks[3].dtype(), v1::DTYPE_UNSPECIFIED);
  std::string joined = chunks[0].data() + chunks[1].data() + chunks[2].data();
  EXPECT_EQ(joined, std::string(a.begin(), a.end()));
}

TEST(ChunkTensors, DefaultLimitIsFourMiBAndLargeTensorsSplitThere) {
  std::vector<uint8_t> big((size_t{9} << 20) + 5);
  auto chunks = Chunk({{"w", big, std::nullopt}}, kMaxChunkBytes);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].data().size(), size_t{4} << 20);
  EXPECT_EQ(chunks[1].offset_bytes(), int64_t{4} << 20);
  EXPECT_EQ(chunks[2].data().size(), (size_t{1} << 20) + 5);
}

TEST(ChunkTensors, EmptyTensorIsOneEmptyChunk) {
  auto chunks = Chunk({{"e", {}, std::nullopt}}, 16);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].total_bytes(), 0);
  EXPECT_TRUE(chunks[0].data().empty());
}

TEST(ChunkTensors, RejectsBadArgumentsBeforeWritingAnything) {
  auto a = Bytes(4, 0);
  int writes = 0;
  auto count = [&writes](const v1::TensorChunk&) { return ++writes, true; };
  EXPECT_EQ(ChunkTensors("s", {{"a", a, {}}}, 0, count).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkTensors("s", {{"a", a, {}}}, kMaxChunkBytes + 1, count).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkTensors("s", {{"a", a, {}}, {"a", a, {}}}, 4, count).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkTensors("s", {{"", a, {}}}, 4, count).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writes, 0);
}

TEST(ChunkTensors, BrokenStreamIsUnavailable) {
  auto a = Bytes(8, 0);
  int writes = 0;
  absl::Status s = ChunkTensors("s", {{"a", a, {}}}, 2,
                                [&writes](const v1::TensorChunk&) { return ++writes < 2; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(writes, 2);
}

TEST(Reassembler, RoundTripsIntoCallerBuffersInAnyOrderAfterTheFirstChunk) {
  auto a = Bytes(1000, 3), b = Bytes(17, 9);
  auto chunks = Chunk({{"a", a, {}}, {"b", b, {}}}, 64);
  // Keep a's first chunk first, reverse the rest of a's.
  std::reverse(chunks.begin() + 1, chunks.begin() + 16);
  std::vector<uint8_t> out_a(1000), out_b(17);
  Reassembler r({{"a", absl::MakeSpan(out_a)}, {"b", absl::MakeSpan(out_b)}});
  for (const auto& c : chunks) ASSERT_TRUE(r.Add(c).ok());
  ASSERT_TRUE(r.Finish().ok());
  EXPECT_EQ(out_a, a);
  EXPECT_EQ(out_b, b);
  EXPECT_EQ(r.chunks(), static_cast<int64_t>(chunks.size()));
}

TEST(Reassembler, MapModeKeepsShapeAndDtypeOfTheFirstChunk) {
  std::vector<float> w = {1, 2, 3, 4, 5, 6};
  auto chunks = Chunk({ConstTensorRef::F32("w", w)}, 8);
  chunks[0].add_shape(2);
  chunks[0].add_shape(3);
  Reassembler r;
  for (const auto& c : chunks) ASSERT_TRUE(r.Add(c).ok());
  ASSERT_TRUE(r.Finish().ok());
  TensorMap m = r.TakeTensors();
  ASSERT_EQ(m.count("w"), 1u);
  EXPECT_EQ(m["w"].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m["w"].dtype, DType::kF32);
  EXPECT_EQ(m["w"].AsF32(), w);
}

TEST(Reassembler, RejectsMalformedStreams) {
  auto a = Bytes(16, 0);
  auto chunks = Chunk({{"a", a, {}}}, 4);
  std::vector<uint8_t> out(16);
  {
    Reassembler r({{"a", absl::MakeSpan(out)}});
    EXPECT_EQ(r.Add(chunks[1]).code(), absl::StatusCode::kInvalidArgument);  // before offset 0
  }
  {
    Reassembler r({{"a", absl::MakeSpan(out)}});
    ASSERT_TRUE(r.Add(chunks[0]).ok());
    EXPECT_EQ(r.Add(chunks[0]).code(), absl::StatusCode::kInvalidArgument);  // overlap
    v1::TensorChunk past = chunks[3];
    past.set_offset_bytes(14);
    EXPECT_EQ(r.Add(past).code(), absl::StatusCode::kInvalidArgument);  // passes the end
    v1::TensorChunk negative = chunks[1];
    negative.set_offset_bytes(-4);
    EXPECT_EQ(r.Add(negative).code(), absl::StatusCode::kInvalidArgument);
    v1::TensorChunk other = chunks[0];
    other.set_name("zzz");
    EXPECT_EQ(r.Add(other).code(), absl::StatusCode::kInvalidArgument);  // not asked for
    EXPECT_EQ(r.Finish().code(), absl::StatusCode::kDataLoss);           // 4 of 16 bytes
  }
  {
    std::vector<uint8_t> small(8);
    Reassembler r({{"a", absl::MakeSpan(small)}});
    EXPECT_EQ(r.Add(chunks[0]).code(), absl::StatusCode::kInvalidArgument);  // size mismatch
  }
  {
    Reassembler r({{"a", absl::MakeSpan(out)}});
    EXPECT_EQ(r.Finish().code(), absl::StatusCode::kDataLoss);  // never sent
  }
}

}  // namespace
}  // namespace diond::client::internal
