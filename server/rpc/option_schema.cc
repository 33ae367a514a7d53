#include "server/rpc/option_schema.h"

#include "kernels/optim/option_table.h"
#include "server/rpc/convert.h"
#include "server/rpc/optimizer_service.h"

namespace diond::rpc {
namespace {

v1::OptionType TypeToProto(optim::OptionType t) {
  switch (t) {
    case optim::OptionType::kDouble:
      return v1::OPTION_TYPE_DOUBLE;
    case optim::OptionType::kInt:
      return v1::OPTION_TYPE_INT64;
    case optim::OptionType::kBool:
      return v1::OPTION_TYPE_BOOL;
    case optim::OptionType::kEnum:
      return v1::OPTION_TYPE_ENUM;
  }
  return v1::OPTION_TYPE_UNSPECIFIED;
}

}  // namespace

void DescribeOptionsToProto(v1::DescribeOptionsResponse* out) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    v1::OptionDescription* d = out->add_options();
    d->set_name(std::string(row.name));
    d->set_type(TypeToProto(row.type));
    for (optim::AlgorithmKind k : optim::kAllAlgorithmKinds) {
      if (row.AppliesTo(k)) d->add_algorithms(AlgorithmToProto(k));
    }
    d->set_refused_elsewhere(row.elsewhere == optim::OptionElsewhere::kRefused);
    if (!row.range.any) {
      d->set_min(row.range.lo);
      d->set_min_exclusive(row.range.lo_open);
      d->set_max(row.range.hi);
      d->set_max_exclusive(row.range.hi_open);
    }
    for (absl::string_view n : row.enum_names) d->add_enum_values(std::string(n));
    d->set_checkpoint_key(std::string(row.member));
  }
  for (optim::AlgorithmKind k : optim::kAllAlgorithmKinds) {
    v1::AlgorithmDefaults* a = out->add_defaults();
    a->set_algorithm(AlgorithmToProto(k));
    HyperparametersToProto(optim::DefaultHyperparams(k), a->mutable_hyperparameters());
  }
}

grpc::ServerUnaryReactor* OptimizerService::DescribeOptions(grpc::CallbackServerContext* ctx,
                                                            const v1::DescribeOptionsRequest*,
                                                            v1::DescribeOptionsResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    DescribeOptionsToProto(resp);
    return absl::OkStatus();
  });
}

}  // namespace diond::rpc
