// The entries of the CUDA plugin's ops table (DiondOpsApiV1), defined in kernels/cuda/ops_*.cu and
// assembled into the table by ops_table.cc. Internal to the plugin; no CUDA types.
#ifndef DIOND_KERNELS_CUDA_OPS_INTERNAL_H_
#define DIOND_KERNELS_CUDA_OPS_INTERNAL_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/plugin_api.h"

namespace diond::cuda {

const DiondOpsApiV1* OpsApi();

// The entry of every row of kernels/ops.def, by its `Name`: ops_memory.cc (memory, copies,
// streams, host registration, stream capture, device_health), ops_blas.cu (GEMM, the symmetric
// products, the factorizations), ops_reduce.cu (norms, top-k, the finiteness scans and the
// checksum), ops_elementwise.cu (gather/scatter, copies, fill, the elementwise ops, AdamW and
// Lion), ops_fused.cu (kops's fused phases, decay_scatter_with_change) and ops_handoff.cu
// (device UUIDs, IPC memory handles, VMM fds, interprocess events). A *_dev entry reads its
// scalars from DEVICE memory when the kernel runs.
#define DIOND_ENTRY(name, Name, ret, c_params) ret Op##Name c_params;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) int Op##Name c_params;
#define DIOND_OP_DEV(name, Name, host_op, c_params) int Op##Name c_params;
#include "kernels/ops.def"

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_OPS_INTERNAL_H_
