// Conformance through the service: every public golden case (tests/conformance/vectors) is
// replayed through the REAL daemon, over shared memory and over Push/Pull streaming, and the
// parameters after every step (and the final state) must equal, bit for bit, the same
// GroupOptimizer path run in this process. Equality is the right criterion: the daemon runs the
// same code on the same fp32 inputs with the same thread count (both sides use all cores), so
// any difference is a transport or conversion bug. The in-process trajectory is in turn checked
// against the golden data with the file's own tolerances (as diond-conformance does), so the
// metadata mapping of golden_case.cc cannot silently map a case onto a different optimizer.
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/golden_case.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> VectorFiles() {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(DIOND_CONFORMANCE_VECTORS, ec)) {
    if (e.path().extension() == ".safetensors") files.push_back(e.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

class ConformanceService : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { daemon_ = Daemon::Start().release(); }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr); }
  static Daemon* daemon_;
};
Daemon* ConformanceService::daemon_ = nullptr;

// The per-step fp32 parameters of the in-process replay, plus its final state.
struct Trajectory {
  std::vector<std::vector<float>> params;
  std::map<std::string, std::vector<float>> state;
};

Trajectory InProcess(const GoldenCase& c, optim::Precision precision, const kernels::Context& ctx) {
  Trajectory t;
  auto r = Replay::Create(c.Session(precision));
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return t;
  for (const auto& [name, v] : c.state_init) EXPECT_TRUE((*r)->SetState(0, name, v).ok()) << name;
  (*r)->params()[0] = c.param_init;
  for (int64_t s = 0; s < c.steps; ++s) {
    EXPECT_TRUE((*r)->Step(ctx, {c.grads[s]}).ok());
    t.params.push_back((*r)->params()[0]);
  }
  for (const std::string& n : (*r)->StateNames(0)) t.state[n] = *(*r)->GetState(0, n);
  return t;
}

// The in-process result meets the golden tolerances (the main checks of runner.cc RunMode).
void CheckAgainstGolden(const GoldenCase& c, optim::Precision precision, const Trajectory& t) {
  const bool bf16_algo = optim::HasBf16Path(c.algorithm);
  if (!bf16_algo || precision == optim::Precision::kBf16Reference) {
    double worst = 0;
    for (int64_t s = 0; s < c.steps; ++s)
      worst = std::max(worst, RelFro(t.params[s], c.ref_params[s]));
    ASSERT_TRUE(c.tolerance.count("param_relfro"));
    EXPECT_LE(worst, c.tolerance.at("param_relfro")) << "max_t relF(p_t, param.<t>)";
  }
  if ((!bf16_algo || precision == optim::Precision::kFp32) && !c.param_f64_final.empty() &&
      c.tolerance.count("param_f64_final_relfro")) {
    EXPECT_LE(RelFro(t.params.back(), c.param_f64_final), c.tolerance.at("param_f64_final_relfro"))
        << "relF(p_T, param_f64.<T>)";
  }
}

// Compares the daemon's GetState (include_parameters) with the replay, bit for bit.
void ExpectStateEquals(v1::Optimizer::Stub& stub, const std::string& session, const Trajectory& t,
                       const std::vector<float>& params) {
  TensorMap state;
  ASSERT_TRUE(GetState(stub, session, true, &state).ok());
  EXPECT_EQ(state["w"], FloatBytes(params)) << "GetState parameters";
  for (const auto& [name, v] : t.state) {
    EXPECT_EQ(state["w/state." + name], FloatBytes(v)) << "state " << name << " differs";
  }
  EXPECT_EQ(state.size(), t.state.size() + 1);
}

std::vector<Chunk> InitialState(const GoldenCase& c, int64_t chunk_bytes) {
  std::vector<Chunk> chunks = SplitTensor("w", FloatBytes(c.param_init), chunk_bytes);
  for (const auto& [name, v] : c.state_init) {
    for (Chunk& ch : SplitTensor("w/state." + name, FloatBytes(v), chunk_bytes)) {
      chunks.push_back(std::move(ch));
    }
  }
  return chunks;
}

void RunOverShm(v1::Optimizer::Stub& stub, const GoldenCase& c, optim::Precision precision,
                const Trajectory& t) {
  auto s = CreateShmSession(stub, c.Session(precision).Request());
  ASSERT_NE(s, nullptr);
  // Initial weights and state (Dion's random Q) go in through SetState; the weights must land
  // in the trainer's shm arena.
  ASSERT_TRUE(SetState(stub, s->id, InitialState(c, 4 << 20)).ok());
  ASSERT_EQ(s->ParamBytes(0), FloatBytes(c.param_init));
  for (int64_t step = 1; step <= c.steps; ++step) {
    s->WriteGrad(0, c.grads[step - 1]);
    v1::StepResponse resp;
    grpc::Status st = DoStep(stub, s->id, step, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(resp.skipped());
    ASSERT_EQ(s->ParamBytes(0), FloatBytes(t.params[step - 1])) << "shm params after step " << step;
  }
  ExpectStateEquals(stub, s->id, t, t.params.back());
  EXPECT_TRUE(CloseSession(stub, s->id).ok());
}

void RunOverStreams(v1::Optimizer::Stub& stub, const GoldenCase& c, optim::Precision precision,
                    const Trajectory& t) {
  v1::CreateSessionResponse created;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(stub.CreateSession(ctx.get(), c.Session(precision).Request(), &created).ok());
  }
  const std::string id = created.session_id();
  // Odd chunk sizes (a multiple of 4 that divides no tensor) exercise reassembly.
  ASSERT_TRUE(SetState(stub, id, InitialState(c, 1028)).ok());
  for (int64_t step = 1; step <= c.steps; ++step) {
    v1::PushGradientsResponse pushed;
    grpc::Status st =
        PushGradients(stub, id, SplitTensor("w", FloatBytes(c.grads[step - 1]), 2052), &pushed);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(pushed.bytes_received(), static_cast<int64_t>(c.grads[step - 1].size() * 4));
    st = DoStep(stub, id, step);
    ASSERT_TRUE(st.ok()) << st.error_message();
    TensorMap pulled;
    st = PullParameters(stub, id, &pulled, 3000);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(pulled["w"], FloatBytes(t.params[step - 1])) << "pulled params after step " << step;
  }
  ExpectStateEquals(stub, id, t, t.params.back());
  EXPECT_TRUE(CloseSession(stub, id).ok());
}

TEST(ConformanceServiceFiles, AllPublicVectorsArePresent) {
  // 23 original cases and the 6 Dion qr_method cases (dion_reference-qr-*, -cqr-*).
  EXPECT_EQ(VectorFiles().size(), 29u) << DIOND_CONFORMANCE_VECTORS;
}

TEST_P(ConformanceService, BitExactOverShmAndStreams) {
  auto c = LoadGoldenCase(absl::StrCat(DIOND_CONFORMANCE_VECTORS, "/", GetParam()));
  ASSERT_TRUE(c.ok()) << c.status();
  auto ctx = kernels::Context::CpuDefault();
  std::vector<optim::Precision> modes = {optim::Precision::kFp32};
  if (optim::HasBf16Path(c->algorithm)) modes.push_back(optim::Precision::kBf16Reference);
  for (optim::Precision precision : modes) {
    SCOPED_TRACE(optim::PrecisionName(precision));
    const Trajectory t = InProcess(*c, precision, *ctx);
    ASSERT_EQ(static_cast<int64_t>(t.params.size()), c->steps);
    CheckAgainstGolden(*c, precision, t);
    {
      SCOPED_TRACE("shm");
      RunOverShm(daemon_->stub(), *c, precision, t);
    }
    {
      SCOPED_TRACE("streams");
      RunOverStreams(daemon_->stub(), *c, precision, t);
    }
  }
  EXPECT_TRUE(daemon_->Serving());
}

std::string CaseName(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param.substr(0, info.param.find(".safetensors"));
  for (char& ch : n) {
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(PublicVectors, ConformanceService, ::testing::ValuesIn(VectorFiles()),
                         CaseName);

}  // namespace
}  // namespace diond::service_testing
