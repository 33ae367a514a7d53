// The trainer's side of an overlapped step (docs/DATA_PLANE.md "Overlapped step") for the
// service suites: a doorbell page in a POSIX shm segment laid out as server/memory/doorbell.h
// reads it, its registration with buckets, and overlapped Steps.
#ifndef DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_
#define DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {

inline int64_t DoorbellBytes(int buckets) { return 64 + 64 * int64_t{buckets}; }

// The page's header ("DIONDDB1", version 1, `buckets`) at `p`, every word 0.
inline void WriteDoorbellHeader(uint8_t* p, uint32_t buckets) {
  std::memset(p, 0, static_cast<size_t>(DoorbellBytes(static_cast<int>(buckets))));
  std::memcpy(p, "DIONDDB1", 8);
  const uint32_t version = 1;
  std::memcpy(p + 8, &version, 4);
  std::memcpy(p + 12, &buckets, 4);
}

// Doorbell words of a page at `base` (the test's mapping).
struct Bells {
  uint8_t* base = nullptr;
  int64_t* word(int k, int which) const {
    return reinterpret_cast<int64_t*>(base + 64 + 64 * int64_t{k} + 8 * which);
  }
  void RingGradients(int k, int64_t step) const {
    __atomic_store_n(word(k, 0), step, __ATOMIC_RELEASE);
  }
  int64_t weights(int k) const { return __atomic_load_n(word(k, 1), __ATOMIC_ACQUIRE); }
  // Polls until every one of `buckets` weights words says `want` (true), or 60 s pass.
  bool AwaitWeights(int buckets, int64_t want) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      bool all = true;
      for (int k = 0; k < buckets; ++k) all = all && weights(k) == want;
      if (all) return true;
      absl::SleepFor(absl::Microseconds(200));
    }
    return false;
  }
};

// RegisterRegion of a DOORBELLS page in shm segment `name`.
inline grpc::Status RegisterShmDoorbells(v1::Optimizer::Stub& stub, const std::string& session,
                                         const std::string& name, int64_t offset, int64_t size,
                                         const std::vector<std::vector<int32_t>>& buckets,
                                         std::string* id = nullptr) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(v1::REGION_ROLE_DOORBELLS);
  req.set_kind(v1::REGION_KIND_SYSTEM_SHM);
  req.mutable_system_shm()->set_name(name);
  req.mutable_system_shm()->set_offset_bytes(offset);
  req.mutable_system_shm()->set_size_bytes(size);
  for (const auto& b : buckets) {
    v1::Bucket* pb = req.add_buckets();
    for (int32_t i : b) pb->add_params(i);
  }
  v1::RegisterRegionResponse resp;
  grpc::Status st = stub.RegisterRegion(Ctx().get(), req, &resp);
  if (id != nullptr) *id = resp.region_id();
  return st;
}

// Step(index) with asynchronous and overlap as given.
inline grpc::Status OverlapStep(v1::Optimizer::Stub& stub, const std::string& session,
                                int64_t index, v1::StepResponse* resp, bool asynchronous = true) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  req.set_asynchronous(asynchronous);
  req.set_overlap(true);
  return stub.Step(Ctx().get(), req, resp);
}

inline grpc::Status WaitStep(v1::Optimizer::Stub& stub, const std::string& session,
                             v1::StepResponse* resp) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_wait(true);
  return stub.Step(Ctx().get(), req, resp);
}

}  // namespace diond::service_testing

#endif  // DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_
