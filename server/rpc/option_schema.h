// The DescribeOptions RPC's answer: the option table (kernels/optim/option_table.h) as
// diond.v1.OptionDescription rows, and every algorithm's defaults as a Hyperparameters message.
// Clients read it instead of keeping their own copy of the options' defaults and ranges.
#ifndef DIOND_SERVER_RPC_OPTION_SCHEMA_H_
#define DIOND_SERVER_RPC_OPTION_SCHEMA_H_

#include "diond/v1/optimizer.pb.h"

namespace diond::rpc {

void DescribeOptionsToProto(v1::DescribeOptionsResponse* out);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_OPTION_SCHEMA_H_
