#include "diond/types.h"

#include "diond/client.h"
#include "gtest/gtest.h"

namespace diond::client {
namespace {

v1::CreateSessionResponse GoodResponse() {
  v1::CreateSessionResponse r;
  r.set_session_id("s1");
  r.set_param_arena_bytes(1024);
  r.set_grad_arena_bytes(1024);
  r.set_alignment_bytes(256);
  v1::TensorLayout* w = r.add_layout();
  w->set_name("w");
  w->add_shape(4);
  w->add_shape(8);
  w->set_dtype(v1::DTYPE_F32);
  w->set_size_bytes(128);
  w->set_param_offset_bytes(0);
  w->set_grad_offset_bytes(256);
  v1::TensorLayout* b = r.add_layout();
  b->set_name("b");
  b->add_shape(8);
  b->set_dtype(v1::DTYPE_BF16);
  b->set_size_bytes(16);
  b->set_param_offset_bytes(768);
  b->set_grad_offset_bytes(0);
  return r;
}

TEST(LayoutFromProto, ConvertsAValidLayout) {
  auto layout = LayoutFromProto(GoodResponse());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->session_id, "s1");
  ASSERT_EQ(layout->tensors.size(), 2u);
  const TensorLayout* b = layout->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  EXPECT_EQ(b->param_offset_bytes, 768);
  EXPECT_EQ(layout->Find("nope"), nullptr);
}

TEST(LayoutFromProto, RejectsLayoutsThatWouldLeaveTheArena) {
  struct Case {
    const char* what;
    void (*mutate)(v1::CreateSessionResponse*);
  };
  Case cases[] = {
      {"past param arena", [](auto* r) { r->mutable_layout(0)->set_param_offset_bytes(1024); }},
      {"past grad arena", [](auto* r) { r->mutable_layout(1)->set_grad_offset_bytes(1024); }},
      {"negative offset", [](auto* r) { r->mutable_layout(0)->set_grad_offset_bytes(-256); }},
      {"size != shape", [](auto* r) { r->mutable_layout(0)->set_size_bytes(64); }},
      {"unknown dtype", [](auto* r) { r->mutable_layout(0)->set_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"unaligned", [](auto* r) { r->mutable_layout(1)->set_param_offset_bytes(512 + 4); }},
      {"duplicate", [](auto* r) { r->mutable_layout(1)->set_name("w"); }},
  };
  for (const Case& c : cases) {
    v1::CreateSessionResponse r = GoodResponse();
    c.mutate(&r);
    EXPECT_EQ(LayoutFromProto(r).status().code(), absl::StatusCode::kInvalidArgument) << c.what;
  }
}

TEST(ToProto, CarriesEveryPlainField) {
  GroupSpec g{"matrices", Algorithm::kMuon, {}};
  g.hyperparams.lr = 0.02;
  g.hyperparams.nesterov = true;
  v1::CreateSessionRequest req =
      ToProto({{"w", {4, 8}, DType::kBF16, "matrices"}}, {g}, {"trainer", true});
  ASSERT_EQ(req.parameters_size(), 1);
  EXPECT_EQ(req.parameters(0).dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(req.parameters(0).shape_size(), 2);
  EXPECT_EQ(req.groups(0).algorithm(), v1::ALGORITHM_MUON);
  EXPECT_TRUE(req.groups(0).hyperparameters().has_lr());
  EXPECT_DOUBLE_EQ(req.groups(0).hyperparameters().lr(), 0.02);
  EXPECT_FALSE(req.groups(0).hyperparameters().has_mu());  // unset stays unset
  EXPECT_TRUE(req.groups(0).hyperparameters().nesterov());
  EXPECT_TRUE(req.fp32_master_weights());
  EXPECT_EQ(req.client_name(), "trainer");
}

TEST(ToProto, CarriesDionsQrMethodOptions) {
  GroupSpec g{"dion", Algorithm::kDion, {}};
  v1::Hyperparameters unset = ToProto(g.hyperparams);
  EXPECT_EQ(unset.qr_method(), v1::QR_METHOD_UNSPECIFIED);  // the daemon's default: rcqr
  EXPECT_FALSE(unset.has_cqr_warmup_steps());
  EXPECT_FALSE(unset.has_oversample());
  g.hyperparams.qr_method = QrMethod::kCqr;
  g.hyperparams.cqr_warmup_steps = 10;
  g.hyperparams.rcqr_oversample = 2.0;
  v1::Hyperparameters h = ToProto(g.hyperparams);
  EXPECT_EQ(h.qr_method(), v1::QR_METHOD_CQR);
  EXPECT_EQ(h.cqr_warmup_steps(), 10);
  EXPECT_DOUBLE_EQ(h.oversample(), 2.0);
  EXPECT_EQ(static_cast<int>(QrMethod::kQr), v1::QR_METHOD_QR);
  EXPECT_EQ(static_cast<int>(QrMethod::kRcqr), v1::QR_METHOD_RCQR);
}

TEST(FromGrpcStatus, MapsEveryCodeOneToOneAndKeepsTheMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  for (int code = 1; code <= 16; ++code) {
    absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(code), "msg"));
    EXPECT_EQ(static_cast<int>(s.code()), code);
    EXPECT_EQ(s.message(), "msg");
  }
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "x")).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(Client, ConnectRejectsBadTargetsAndOptions) {
  EXPECT_EQ(Client::Connect("").status().code(), absl::StatusCode::kInvalidArgument);
  ClientOptions o;
  o.connect_timeout = absl::ZeroDuration();
  o.chunk_bytes = (int64_t{4} << 20) + 1;
  EXPECT_EQ(Client::Connect("unix:/nonexistent/d.sock", o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.chunk_bytes = 1024;
  o.connect_timeout = absl::Milliseconds(200);
  EXPECT_EQ(Client::Connect("unix:/nonexistent/d.sock", o).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace diond::client
