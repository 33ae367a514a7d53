// NCCL communicators behind the plugin's C ABI (plugin_api.h, DiondNcclApiV1). Internal to the
// plugin: plugin.cc puts the table into DiondCudaPluginV1.
#ifndef DIOND_KERNELS_CUDA_NCCL_COMM_H_
#define DIOND_KERNELS_CUDA_NCCL_COMM_H_

#include "kernels/cuda/plugin_api.h"

namespace diond::cuda {

const DiondNcclApiV1* NcclApi();

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_NCCL_COMM_H_
