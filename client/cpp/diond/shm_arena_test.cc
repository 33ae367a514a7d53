#include "diond/shm_arena.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <string>

#include "gtest/gtest.h"

namespace diond::client {
namespace {

// Two f32 matrices and a bf16 vector, laid out as a daemon would: 256-aligned offsets.
Layout TestLayout() {
  Layout l;
  l.session_id = "s";
  l.alignment_bytes = 256;
  l.tensors = {
      {"w1", 0, 0, 64 * 16 * 4, {64, 16}, DType::kF32},
      {"w2", 4096, 4096, 4 * 64 * 4, {4, 64}, DType::kF32},
      {"b1", 5120, 5120, 64 * 2, {64}, DType::kBF16},
  };
  l.param_arena_bytes = 5376;
  l.grad_arena_bytes = 5376;
  return l;
}

// Lines of /proc/self/maps that map one of our shm segments. (Counting all lines is flaky: the
// allocator and std::regex map memory of their own on first use.)
int MapsLines() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/diond-") != std::string::npos) ++n;
  }
  return n;
}

bool ShmExists(const std::string& name, mode_t* mode = nullptr) {
  struct stat st;
  if (stat(("/dev/shm/" + name).c_str(), &st) != 0) return false;
  if (mode != nullptr) *mode = st.st_mode & 0777;
  return true;
}

// Entries of /dev/shm made by this process ("diond-<pid>-...").
int CountOwnSegments() {
  const std::string prefix = "diond-" + std::to_string(getpid()) + "-";
  int n = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) ++n;
  }
  closedir(dir);
  return n;
}

TEST(RandomShmName, MatchesTheProtoPattern) {
  const std::regex pattern("[A-Za-z0-9._-]{1,200}");
  std::string a = RandomShmName(), b = RandomShmName();
  EXPECT_TRUE(std::regex_match(a, pattern)) << a;
  EXPECT_NE(a, b);
}

class ShmArenaTest : public ::testing::TestWithParam<bool> {};

TEST_P(ShmArenaTest, SegmentsAre0600SpansSitAtTheirOffsetsAndEverythingGoesAway) {
  const bool single = GetParam();
  const int maps_before = MapsLines();
  std::vector<std::string> names;
  {
    auto arena = ShmArena::CreateUnregistered(TestLayout(), {single});
    ASSERT_TRUE(arena.ok()) << arena.status();
    ASSERT_EQ(arena->segments().size(), single ? 1u : 2u);
    EXPECT_EQ(MapsLines(), maps_before + (single ? 1 : 2));  // the count sees our mappings
    const std::regex pattern("[A-Za-z0-9._-]{1,200}");
    for (const auto& seg : arena->segments()) {
      names.push_back(seg.name);
      EXPECT_TRUE(std::regex_match(seg.name, pattern)) << seg.name;
      mode_t mode = 0;
      ASSERT_TRUE(ShmExists(seg.name, &mode)) << seg.name;
      EXPECT_EQ(mode, 0600u) << seg.name;
    }
    if (single) {
      // Both arenas in one segment, gradients after the parameters at a page boundary.
      const auto& seg = arena->segments()[0];
      EXPECT_EQ(arena->param_arena(), seg.base);
      const int64_t grad_off = arena->grad_arena() - seg.base;
      EXPECT_GE(grad_off, 5376);
      EXPECT_EQ(grad_off % 4096, 0);
      EXPECT_GE(seg.size_bytes, grad_off + 5376);
    } else {
      EXPECT_EQ(arena->param_arena(), arena->segments()[0].base);
      EXPECT_EQ(arena->grad_arena(), arena->segments()[1].base);
      EXPECT_EQ(arena->segments()[0].size_bytes, 5376);
    }
    for (const TensorLayout& t : TestLayout().tensors) {
      auto p = arena->ParamBytes(t.name);
      auto g = arena->GradBytes(t.name);
      ASSERT_TRUE(p.ok() && g.ok());
      EXPECT_EQ(p->data() - arena->param_arena(), t.param_offset_bytes) << t.name;
      EXPECT_EQ(g->data() - arena->grad_arena(), t.grad_offset_bytes) << t.name;
      EXPECT_EQ(static_cast<int64_t>(p->size()), t.size_bytes);
    }
    auto w1 = arena->Param("w1");
    ASSERT_TRUE(w1.ok());
    EXPECT_EQ(w1->size(), 64u * 16u);
    (*w1)[0] = 1.5f;  // writable, shared
    auto b1 = arena->GradBf16("b1");
    ASSERT_TRUE(b1.ok());
    EXPECT_EQ(b1->size(), 64u);
    EXPECT_EQ(arena->Param("b1").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(arena->ParamBf16("w1").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(arena->Grad("nope").status().code(), absl::StatusCode::kNotFound);

    // Move-only: the moved-to arena owns the segments, the moved-from one is empty.
    ShmArena moved = *std::move(arena);
    EXPECT_TRUE(arena->segments().empty());
    EXPECT_EQ(arena->Param("w1").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*moved.Param("w1"))[0], 1.5f);
    for (const auto& n : names) EXPECT_TRUE(ShmExists(n)) << n;
  }
  for (const auto& n : names) EXPECT_FALSE(ShmExists(n)) << n << " not unlinked";
  EXPECT_EQ(MapsLines(), maps_before) << "a mapping leaked";
}

INSTANTIATE_TEST_SUITE_P(SingleAndTwoSegments, ShmArenaTest, ::testing::Bool());

TEST(ShmArena, RejectsEmptyAndOutOfBoundsLayoutsWithoutLeavingAnything) {
  const int maps_before = MapsLines();
  Layout empty;
  EXPECT_EQ(ShmArena::CreateUnregistered(empty).status().code(),
            absl::StatusCode::kInvalidArgument);
  Layout bad = TestLayout();
  bad.tensors[1].grad_offset_bytes = 5376;
  EXPECT_EQ(ShmArena::CreateUnregistered(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmArena::Create(nullptr, TestLayout()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MapsLines(), maps_before);
}

TEST(ShmArena, FailedRegistrationLeavesNoSegment) {
  // A daemon that is not there: registration fails, and the segment must be gone again.
  ClientOptions o;
  o.connect_timeout = absl::ZeroDuration();
  o.deadline = absl::Milliseconds(300);
  auto client = Client::Connect("unix:/nonexistent-diond/d.sock", o);
  ASSERT_TRUE(client.ok());
  const int segs_before = CountOwnSegments();
  auto arena = ShmArena::Create(client->get(), TestLayout());
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kUnavailable) << arena.status();
  // (No /proc/self/maps count here: the failed RPC starts gRPC threads, whose stacks map.)
  EXPECT_EQ(CountOwnSegments(), segs_before);
}

}  // namespace
}  // namespace diond::client
