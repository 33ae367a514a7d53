#include "tests/service/service_harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/support/client_interceptor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace diond::service_testing {

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kRpcDeadlineSeconds));
  return ctx;
}

// ---- credentials --------------------------------------------------------------------------------

namespace {

class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->insert({"authorization", value_});
    }
    m->Proceed();
  }

 private:
  std::string value_;
};

class BearerFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(value_);
  }

 private:
  std::string value_;
};

bool HasFlag(const std::vector<std::string>& flags, absl::string_view name) {
  for (const auto& f : flags) {
    if (absl::StartsWith(f, absl::StrCat(name, "="))) return true;
  }
  return false;
}

}  // namespace

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  chmod(path.c_str(), 0600);
}

std::shared_ptr<grpc::Channel> TokenChannel(
    const std::string& target, const std::string& token,
    const std::shared_ptr<grpc::ChannelCredentials>& creds) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> f;
  if (!token.empty()) f.push_back(std::make_unique<BearerFactory>("Bearer " + token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, creds, grpc::ChannelArguments(), std::move(f));
}

// ---- Daemon ------------------------------------------------------------------------------------

std::unique_ptr<Daemon> Daemon::Start(const std::vector<std::string>& flags, bool tcp,
                                      const std::string& dir) {
  return Launch({DIOND_BINARY}, flags, tcp, dir);
}

std::unique_ptr<Daemon> Daemon::StartBinary(const std::string& binary,
                                            const std::vector<std::string>& flags,
                                            const std::vector<std::string>& env, bool tcp) {
  std::vector<std::string> prefix;
  if (!env.empty()) {
    prefix.push_back("/usr/bin/env");
    prefix.insert(prefix.end(), env.begin(), env.end());
  }
  prefix.push_back(binary);
  return Launch(std::move(prefix), flags, tcp, "");
}

std::unique_ptr<Daemon> Daemon::Launch(std::vector<std::string> prefix,
                                       const std::vector<std::string>& flags, bool tcp,
                                       const std::string& dir) {
  std::unique_ptr<Daemon> d(new Daemon);
  d->dir_ = dir.empty() ? testing::MakeTempDir("diond_svc") : dir;
  d->socket_ = d->dir_ + "/d.sock";
  const std::string ready = d->dir_ + "/ready.json";
  unlink(ready.c_str());
  unlink(d->socket_.c_str());
  std::vector<std::string> argv = std::move(prefix);
  for (std::string a :
       {"--listen=unix:" + d->socket_ + (tcp ? ",127.0.0.1:0" : ""),
        std::string("--metrics_address="), std::string("--device=cpu"), "--ready_file=" + ready}) {
    argv.push_back(std::move(a));
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  if (tcp && !HasFlag(flags, "--auth_token_file") &&
      !HasFlag(flags, "--allow_unauthenticated_tcp")) {
    WriteText(d->dir_ + "/tokens", absl::StrCat(kTcpToken, " svc-test admin\n"));
    argv.push_back("--auth_token_file=" + d->dir_ + "/tokens");
  }
  if (HasFlag(flags, "--world_size") && !HasFlag(flags, "--world_secret_file")) {
    WriteText(d->dir_ + "/world.secret", kWorldSecret);
    argv.push_back("--world_secret_file=" + d->dir_ + "/world.secret");
  }
  d->proc_ = std::make_unique<testing::Subprocess>(
      argv, absl::StrCat(d->dir_, "/log-", absl::ToUnixNanos(absl::Now()), ".txt"));
  // Poll for the ready file, which the daemon writes atomically once it serves.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::string text = testing::ReadFile(ready);
    if (!text.empty()) {
      nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      if (!j.is_discarded() && j.contains("listen")) {
        for (const auto& e : j["listen"]) {
          if (e.contains("port")) d->tcp_port_ = e["port"].get<int>();
        }
      }
      if (!j.is_discarded() && j.contains("metrics_port")) {
        d->metrics_port_ = j["metrics_port"].get<int>();
      }
      d->channel_ = grpc::CreateChannel("unix:" + d->socket_, grpc::InsecureChannelCredentials());
      d->stub_ = v1::Optimizer::NewStub(d->channel_);
      return d;
    }
    if (d->proc_->Wait(absl::ZeroDuration()).has_value()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << "diond did not become ready; log:\n" << d->proc_->Log();
  return nullptr;
}

std::unique_ptr<v1::Optimizer::Stub> Daemon::NewTcpStub(const std::string& token) const {
  return v1::Optimizer::NewStub(TokenChannel(absl::StrCat("127.0.0.1:", tcp_port_), token));
}

bool Daemon::Serving() const {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  auto ctx = Ctx();
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("diond.v1.Optimizer");
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = health->Check(ctx.get(), req, &resp);
  return s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

void Daemon::Kill() {
  proc_->Signal(SIGKILL);
  proc_->Wait(absl::Seconds(30));
}

std::optional<int> Daemon::Terminate(absl::Duration timeout) {
  proc_->Signal(SIGTERM);
  return proc_->Wait(timeout);
}

bool Daemon::Alive() { return !proc_->Wait(absl::ZeroDuration()).has_value(); }

// ---- shm ---------------------------------------------------------------------------------------

std::unique_ptr<ShmSegment> ShmSegment::Create(int64_t bytes) {
  static std::atomic<int> counter{0};
  // A random part besides the pid: a test process that was killed leaves its segments behind,
  // and a later process with the same pid would otherwise collide with them (EEXIST).
  static const uint64_t run_id = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  std::unique_ptr<ShmSegment> s(new ShmSegment);
  s->name_ = absl::StrCat(kShmPrefix, getpid(), "-", absl::Hex(run_id), "-", counter++);
  int fd = shm_open(("/" + s->name_).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    ADD_FAILURE() << "shm_open " << s->name_ << ": " << std::strerror(errno);
    return nullptr;
  }
  if (ftruncate(fd, bytes) != 0) {
    ADD_FAILURE() << "ftruncate " << s->name_ << ": " << std::strerror(errno);
    close(fd);
    shm_unlink(("/" + s->name_).c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    ADD_FAILURE() << "mmap " << s->name_ << ": " << std::strerror(errno);
    shm_unlink(("/" + s->name_).c_str());
    return nullptr;
  }
  s->data_ = static_cast<uint8_t*>(p);
  s->size_ = bytes;
  return s;
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  shm_unlink(("/" + name_).c_str());
}

std::string ShmSegment::Bytes(int64_t offset, int64_t len) const {
  return std::string(reinterpret_cast<const char*>(data_) + offset, static_cast<size_t>(len));
}

void ShmSegment::Write(int64_t offset, const std::string& bytes) {
  std::memcpy(data_ + offset, bytes.data(), bytes.size());
}

bool ShmSegment::Truncate(int64_t bytes) {
  int fd = shm_open(("/" + name_).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = ftruncate(fd, bytes) == 0;
  close(fd);
  return ok;
}

std::vector<std::string> LeftoverShmSegments() {
  std::vector<std::string> out;
  const std::string mine = absl::StrCat(kShmPrefix, getpid(), "-");
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (absl::StartsWith(e->d_name, mine)) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

// ---- bytes -------------------------------------------------------------------------------------

std::string FloatBytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::string Bf16Bytes(const std::vector<float>& v) {
  const std::string f = FloatBytes(v);
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += f.substr(4 * i + 2, 2);  // little-endian
  return out;
}

std::vector<float> BytesToFloats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

uint64_t Fnv1a(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// ---- streams -----------------------------------------------------------------------------------

std::vector<Chunk> SplitTensor(const std::string& name, const std::string& bytes,
                               int64_t chunk_bytes) {
  std::vector<Chunk> out;
  for (int64_t off = 0; off < static_cast<int64_t>(bytes.size()); off += chunk_bytes) {
    out.push_back(
        {name, off, bytes.substr(static_cast<size_t>(off), static_cast<size_t>(chunk_bytes))});
  }
  return out;
}

namespace {

template <typename Writer>
void WriteChunks(Writer* w, const std::string& session, const std::vector<Chunk>& chunks) {
  bool first = true;
  for (const Chunk& c : chunks) {
    v1::TensorChunk m;
    if (first) m.set_session_id(session);
    first = false;
    m.set_name(c.name);
    m.set_offset_bytes(c.offset);
    m.set_data(c.data);
    if (!w->Write(m)) break;  // the server ended the stream early; Finish() has its status
  }
  w->WritesDone();
}

grpc::Status ReadChunks(grpc::ClientReader<v1::TensorChunk>* r, TensorMap* out) {
  v1::TensorChunk c;
  std::string error;
  while (r->Read(&c)) {
    std::string& buf = (*out)[c.name()];
    if (c.offset_bytes() != static_cast<int64_t>(buf.size()) && error.empty()) {
      error = absl::StrCat("chunk of '", c.name(), "' at ", c.offset_bytes(), " after ", buf.size(),
                           " bytes");
    }
    if (c.offset_bytes() == 0 && c.total_bytes() <= 0 && error.empty()) {
      error = absl::StrCat("first chunk of '", c.name(), "' lacks total_bytes");
    }
    buf += c.data();
  }
  grpc::Status s = r->Finish();
  if (s.ok() && !error.empty()) return grpc::Status(grpc::StatusCode::INTERNAL, error);
  return s;
}

}  // namespace

grpc::Status SetState(v1::Optimizer::Stub& stub, const std::string& session,
                      const std::vector<Chunk>& chunks, v1::SetStateResponse* resp) {
  auto ctx = Ctx();
  v1::SetStateResponse local;
  auto w = stub.SetState(ctx.get(), resp ? resp : &local);
  WriteChunks(w.get(), session, chunks);
  return w->Finish();
}

grpc::Status PushGradients(v1::Optimizer::Stub& stub, const std::string& session,
                           const std::vector<Chunk>& chunks, v1::PushGradientsResponse* resp) {
  auto ctx = Ctx();
  v1::PushGradientsResponse local;
  auto w = stub.PushGradients(ctx.get(), resp ? resp : &local);
  WriteChunks(w.get(), session, chunks);
  return w->Finish();
}

grpc::Status GetState(v1::Optimizer::Stub& stub, const std::string& session,
                      bool include_parameters, TensorMap* out) {
  auto ctx = Ctx();
  v1::GetStateRequest req;
  req.set_session_id(session);
  req.set_include_parameters(include_parameters);
  out->clear();
  auto r = stub.GetState(ctx.get(), req);
  return ReadChunks(r.get(), out);
}

grpc::Status PullParameters(v1::Optimizer::Stub& stub, const std::string& session, TensorMap* out,
                            int64_t chunk_bytes, const std::vector<std::string>& names) {
  auto ctx = Ctx();
  v1::PullParametersRequest req;
  req.set_session_id(session);
  req.set_chunk_bytes(chunk_bytes);
  for (const auto& n : names) req.add_names(n);
  out->clear();
  auto r = stub.PullParameters(ctx.get(), req);
  return ReadChunks(r.get(), out);
}

// ---- sessions ----------------------------------------------------------------------------------

v1::CreateSessionRequest SessionDesc::Request() const {
  v1::CreateSessionRequest req;
  for (const GroupDesc& g : groups) *req.add_groups() = g.proto;
  for (const ParamDesc& p : params) {
    v1::ParameterSpec* s = req.add_parameters();
    s->set_name(p.name);
    for (int64_t d : p.shape) s->add_shape(d);
    s->set_dtype(v1::DTYPE_F32);
    s->set_group(p.group);
  }
  req.set_non_finite_policy(non_finite);
  req.set_client_name("service-test");
  return req;
}

int64_t SessionDesc::Numel(size_t param) const {
  int64_t n = 1;
  for (int64_t d : params[param].shape) n *= d;
  return n;
}

v1::Algorithm AlgorithmToProto(optim::AlgorithmKind kind) {
  switch (kind) {
    case optim::AlgorithmKind::kMuon:
      return v1::ALGORITHM_MUON;
    case optim::AlgorithmKind::kNorMuon:
      return v1::ALGORITHM_NORMUON;
    case optim::AlgorithmKind::kDion:
      return v1::ALGORITHM_DION;
    case optim::AlgorithmKind::kDion2:
      return v1::ALGORITHM_DION2;
    case optim::AlgorithmKind::kNorDion2:
      return v1::ALGORITHM_DION3;
    case optim::AlgorithmKind::kAdamW:
      return v1::ALGORITHM_ADAMW;
    case optim::AlgorithmKind::kLion:
      return v1::ALGORITHM_LION;
  }
  return v1::ALGORITHM_UNSPECIFIED;
}

GroupDesc MakeGroup(const std::string& name, optim::AlgorithmKind algorithm, double lr) {
  GroupDesc g;
  g.proto.set_name(name);
  g.proto.set_algorithm(AlgorithmToProto(algorithm));
  g.proto.mutable_hyperparameters()->set_lr(lr);
  g.config.algorithm = algorithm;
  g.config.hyperparams = optim::DefaultHyperparams(algorithm);
  g.config.hyperparams.lr = lr;
  return g;
}

std::vector<float> SyntheticValues(uint64_t seed, int64_t step, size_t param, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(step) << 20) ^
               (static_cast<uint64_t>(param) << 48);
  for (int64_t i = 0; i < n; ++i) {
    // splitmix64
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    v[static_cast<size_t>(i)] = static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
  }
  return v;
}

std::vector<Chunk> SyntheticWeights(const SessionDesc& d, uint64_t seed) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < d.params.size(); ++i) {
    chunks.push_back({d.params[i].name, 0, FloatBytes(SyntheticValues(seed, 0, i, d.Numel(i)))});
  }
  return chunks;
}

SessionDesc TwoMatricesAndABias(optim::AlgorithmKind algorithm) {
  SessionDesc d;
  d.groups.push_back(MakeGroup("main", algorithm, 0.01));
  d.groups.push_back(MakeGroup("vec", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w", {24, 16}, "main"});
  d.params.push_back({"u", {16, 24}, "main"});
  d.params.push_back({"b", {16}, "vec"});
  return d;
}

std::vector<int64_t> CheckpointSteps(const std::string& dir, std::vector<std::string>* others) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    int64_t step;
    if (absl::StartsWith(n, "step-") && absl::SimpleAtoi(n.substr(5), &step)) {
      steps.push_back(step);
    } else if (others != nullptr) {
      others->push_back(n);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

grpc::Status LoadCheckpointFrom(v1::Optimizer::Stub& stub, const std::string& path,
                                v1::LoadCheckpointResponse* resp) {
  v1::LoadCheckpointRequest r;
  r.set_path(path);
  return stub.LoadCheckpoint(Ctx().get(), r, resp);
}

size_t SessionCount(v1::Optimizer::Stub& stub) {
  v1::ListSessionsResponse list;
  EXPECT_TRUE(stub.ListSessions(Ctx().get(), v1::ListSessionsRequest(), &list).ok());
  return static_cast<size_t>(list.sessions_size());
}

void WriteSyntheticGrads(ShmSession* s, const SessionDesc& d, uint64_t seed, int64_t t) {
  for (size_t i = 0; i < d.params.size(); ++i) {
    s->WriteGrad(i, SyntheticValues(seed, t, i, d.Numel(i)));
  }
}

absl::StatusOr<std::unique_ptr<Replay>> Replay::Create(const SessionDesc& desc) {
  std::unique_ptr<Replay> r(new Replay);
  r->groups_.resize(desc.groups.size());
  r->group_of_.resize(desc.params.size());
  r->slot_of_.resize(desc.params.size());
  r->params_.resize(desc.params.size());
  for (size_t i = 0; i < desc.params.size(); ++i) {
    size_t g = 0;
    while (g < desc.groups.size() && desc.groups[g].proto.name() != desc.params[i].group) ++g;
    if (g == desc.groups.size()) return absl::InvalidArgumentError("unknown group");
    r->group_of_[i] = g;
    r->slot_of_[i] = r->groups_[g].params.size();
    r->groups_[g].params.push_back(i);
    r->params_[i].assign(static_cast<size_t>(desc.Numel(i)), 0.0f);
  }
  for (size_t g = 0; g < desc.groups.size(); ++g) {
    if (r->groups_[g].params.empty()) continue;
    std::vector<optim::ParamShape> shapes;
    for (size_t i : r->groups_[g].params) shapes.push_back(desc.params[i].shape);
    auto opt = optim::CreateGroupOptimizer(desc.groups[g].config, shapes);
    if (!opt.ok()) return opt.status();
    r->groups_[g].opt = std::move(*opt);
  }
  return r;
}

absl::Status Replay::SetState(size_t param, const std::string& state, const std::vector<float>& v) {
  return groups_[group_of_[param]].opt->SetState(slot_of_[param], state, v);
}

absl::StatusOr<std::vector<float>> Replay::GetState(size_t param, const std::string& state) const {
  const auto& opt = groups_[group_of_[param]].opt;
  auto shape = opt->StateShape(slot_of_[param], state);
  if (!shape.ok()) return shape.status();
  int64_t n = 1;
  for (int64_t d : *shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  absl::Status s = opt->GetState(slot_of_[param], state, absl::MakeSpan(v));
  if (!s.ok()) return s;
  return v;
}

std::vector<std::string> Replay::StateNames(size_t param) const {
  return groups_[group_of_[param]].opt->StateNames();
}

absl::Status Replay::Step(const kernels::Context& ctx,
                          const std::vector<std::vector<float>>& grads) {
  return Step(ctx, grads, std::vector<bool>(params_.size(), false));
}

absl::Status Replay::Step(const kernels::Context& ctx, const std::vector<std::vector<float>>& grads,
                          const std::vector<bool>& no_grad) {
  for (Group& g : groups_) {
    if (g.opt == nullptr) continue;
    std::vector<float*> p;
    std::vector<const float*> gr;
    bool any = false;
    for (size_t i : g.params) {
      p.push_back(params_[i].data());
      gr.push_back(no_grad[i] ? nullptr : grads[i].data());
      any = any || !no_grad[i];
    }
    if (!any) continue;  // as the session: a group without any gradient is not stepped
    optim::StepOptions o;
    o.step = steps_ + 1;  // the session's step index, whichever groups stepped before
    absl::Status s = g.opt->Step(ctx, p, gr, o);
    if (!s.ok()) return s;
  }
  ++steps_;
  return absl::OkStatus();
}

// ---- shm sessions ------------------------------------------------------------------------------

std::string ShmSession::ParamBytes(size_t i) const {
  return params_seg->Bytes(tensor(i).param_offset_bytes(), tensor(i).size_bytes());
}

void ShmSession::WriteGrad(size_t i, const std::vector<float>& g) {
  WriteGradBytes(i, FloatBytes(g));
}

void ShmSession::WriteGradBytes(size_t i, const std::string& bytes) {
  grads().Write(grad_base + tensor(i).grad_offset_bytes(), bytes);
}

std::unique_ptr<ShmSession> CreateShmSession(v1::Optimizer::Stub& stub,
                                             const v1::CreateSessionRequest& req,
                                             bool two_segments) {
  v1::CreateSessionResponse layout;
  {
    auto ctx = Ctx();
    grpc::Status st = stub.CreateSession(ctx.get(), req, &layout);
    if (!st.ok()) {
      ADD_FAILURE() << "CreateSession: " << st.error_message();
      return nullptr;
    }
  }
  return BindShmSession(stub, layout, two_segments);
}

std::unique_ptr<ShmSession> BindShmSession(v1::Optimizer::Stub& stub,
                                           const v1::CreateSessionResponse& layout,
                                           bool two_segments) {
  auto s = std::make_unique<ShmSession>();
  s->layout = layout;
  s->id = s->layout.session_id();
  const int64_t p = s->layout.param_arena_bytes(), g = s->layout.grad_arena_bytes();
  if (two_segments) {
    s->params_seg = ShmSegment::Create(p);
    s->grads_seg = ShmSegment::Create(g);
    s->grad_base = 0;
  } else {
    s->grad_base = (p + 255) / 256 * 256;
    s->params_seg = ShmSegment::Create(s->grad_base + g);
  }
  if (s->params_seg == nullptr || (two_segments && s->grads_seg == nullptr)) return nullptr;
  for (v1::RegionRole role : {v1::REGION_ROLE_PARAMETERS, v1::REGION_ROLE_GRADIENTS}) {
    v1::RegisterRegionRequest r;
    r.set_session_id(s->id);
    r.set_role(role);
    r.set_kind(v1::REGION_KIND_SYSTEM_SHM);
    const bool params = role == v1::REGION_ROLE_PARAMETERS;
    r.mutable_system_shm()->set_name(params ? s->params_seg->name() : s->grads().name());
    r.mutable_system_shm()->set_offset_bytes(params ? 0 : s->grad_base);
    r.mutable_system_shm()->set_size_bytes(params ? p : g);
    v1::RegisterRegionResponse resp;
    auto ctx = Ctx();
    grpc::Status st = stub.RegisterRegion(ctx.get(), r, &resp);
    if (!st.ok()) {
      ADD_FAILURE() << "RegisterRegion: " << st.error_message();
      return nullptr;
    }
    (params ? s->param_region : s->grad_region) = resp.region_id();
  }
  return s;
}

grpc::Status DoStep(v1::Optimizer::Stub& stub, const std::string& session, int64_t index,
                    v1::StepResponse* resp) {
  auto ctx = Ctx();
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  v1::StepResponse local;
  return stub.Step(ctx.get(), req, resp ? resp : &local);
}

grpc::Status DoStepWithout(v1::Optimizer::Stub& stub, const std::string& session, int64_t index,
                           const std::vector<int32_t>& params_without_grad,
                           v1::StepResponse* resp) {
  auto ctx = Ctx();
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  req.mutable_params_without_grad()->Add(params_without_grad.begin(), params_without_grad.end());
  v1::StepResponse local;
  return stub.Step(ctx.get(), req, resp ? resp : &local);
}

grpc::Status CloseSession(v1::Optimizer::Stub& stub, const std::string& session) {
  auto ctx = Ctx();
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  v1::CloseSessionResponse resp;
  return stub.CloseSession(ctx.get(), req, &resp);
}

std::map<std::string, int64_t> LastCounters(const Daemon& d) {
  const std::string log = d.Log();
  const size_t at = log.rfind("test device counters:");
  std::map<std::string, int64_t> out;
  if (at == std::string::npos) return out;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  static const std::regex kv("([a-z_]+)=([0-9]+)");
  for (std::sregex_iterator it(line.begin(), line.end(), kv), end; it != end; ++it) {
    int64_t v = 0;
    if (absl::SimpleAtoi((*it)[2].str(), &v)) out[(*it)[1].str()] = v;
  }
  return out;
}

}  // namespace diond::service_testing
