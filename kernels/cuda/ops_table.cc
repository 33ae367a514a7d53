// The CUDA plugin's ops table (DiondOpsApiV1, kernels/cuda/plugin_api.h): every row of
// kernels/ops.def, entry `name` implemented by OpName of kernels/cuda/ops_*. plugin.cc puts it
// into DiondCudaPluginV1::ops.
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {

const DiondOpsApiV1* OpsApi() {
  static const DiondOpsApiV1 kOps = [] {
    DiondOpsApiV1 t{};
    t.version = DIOND_OPS_API_VERSION;
    t.name = "cuda";
#define DIOND_ENTRY(name, Name, ret, c_params) t.name = &Op##Name;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) t.name = &Op##Name;
#define DIOND_OP_DEV(name, Name, host_op, c_params) t.name = &Op##Name;
#include "kernels/ops.def"
    return t;
  }();
  return &kOps;
}

}  // namespace diond::cuda
