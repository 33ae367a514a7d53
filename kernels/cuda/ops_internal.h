// The entries of the CUDA plugin's ops table (DiondOpsApiV1), defined in kernels/cuda/ops_*.cu and
// assembled into the table by ops_table.cc. Internal to the plugin; no CUDA types.
#ifndef DIOND_KERNELS_CUDA_OPS_INTERNAL_H_
#define DIOND_KERNELS_CUDA_OPS_INTERNAL_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/plugin_api.h"

namespace diond::cuda {

const DiondOpsApiV1* OpsApi();

// ops_memory.cu
int OpAllocate(const DiondOpsCall* call, size_t bytes, void** ptr);
void OpDeallocate(int device, void* stream, void* ptr, size_t bytes);
int OpCopyFromHost(const DiondOpsCall* call, const void* host, void* dst, size_t bytes);
int OpCopyToHost(const DiondOpsCall* call, const void* src, void* host, size_t bytes);
int OpStreamCreate(const DiondOpsCall* call, void** stream);
void OpStreamDestroy(int device, void* stream);
int OpStreamSynchronize(const DiondOpsCall* call);
int OpMemoryStats(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak);
int OpDeviceHealth(const DiondOpsCall* call);

// ops_blas.cu
int OpGemm(const DiondOpsCall*, const DiondGemmArgs*, DiondIn a, DiondIn b, DiondOut c);
int OpSymmetricProduct(const DiondOpsCall*, int32_t aat, float alpha, DiondIn a, float beta,
                       DiondOut c);
int OpSymmetricProductBf16(const DiondOpsCall*, DiondIn a, int64_t block, DiondOut c);
int OpThinQr(const DiondOpsCall*, DiondIn a, DiondOut q, DiondOut r);
int OpCholeskyQr(const DiondOpsCall*, DiondIn a, DiondOut q, DiondOut r);
int OpRandomizedCholeskyQr(const DiondOpsCall*, DiondIn a, DiondIn sketch, DiondOut q);

// ops_reduce.cu
int OpFrobeniusNorm(const DiondOpsCall*, DiondIn a, DiondOut out);
int OpAxisNorms(const DiondOpsCall*, DiondIn a, int32_t axis, int32_t norm, DiondOut out);
int OpTopKByL1Norm(const DiondOpsCall*, DiondIn a, int32_t axis, int64_t k, int64_t* indices,
                   DiondOut scores_out);
int OpIsAllZero(const DiondOpsCall*, DiondIn a, int32_t* all_zero);

// ops_elementwise.cu
int OpGather(const DiondOpsCall*, DiondIn a, int32_t axis, const int64_t* indices, int64_t count,
             DiondOut out);
int OpScatter(const DiondOpsCall*, DiondIn src, int32_t axis, const int64_t* indices,
              int64_t count, float alpha, float beta, DiondOut dst);
int OpCopy(const DiondOpsCall*, DiondIn src, DiondOut dst);
int OpFill(const DiondOpsCall*, float value, DiondOut dst);
int OpAxpby(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondIn y, DiondOut out);
int OpAddScalar(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondOut out);
int OpUnary(const DiondOpsCall*, int32_t op, DiondIn x, DiondOut out);
int OpBinary(const DiondOpsCall*, int32_t op, DiondIn x, DiondIn y, DiondOut out);
int OpAddToDiagonal(const DiondOpsCall*, float value, DiondOut a);
int OpBf16RoundedAxpby(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondIn y,
                       DiondOut out);
int OpAdamWStep(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad, DiondOut x,
                DiondOut m, DiondOut v);
int OpLionStep(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
               DiondOut m);
// ... with the scalars in DEVICE memory, read by the kernel (graph: DIOND_OPS_API_VERSION 8).
int OpAdamWStepDev(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad, DiondOut x,
                   DiondOut m, DiondOut v);
int OpLionStepDev(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                  DiondOut m);

// ops_fused.cu (kops's fused optimizer phases)
int OpAdamWStepTracked(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad, DiondOut x,
                       DiondOut m, DiondOut v, DiondOut update_sq);
int OpLionStepTracked(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                      DiondOut m, DiondOut update_sq);
int OpMomentumUpdate(const DiondOpsCall*, float mu, int32_t nesterov, DiondIn grad,
                     DiondIn m_in, DiondOut m, DiondOut u);
int OpApplyUpdate(const DiondOpsCall*, const DiondApplyUpdateScalars*, DiondIn update,
                  DiondIn x_in, DiondOut x);
// ... with the scalars in DEVICE memory, read by the kernels (graph).
int OpAdamWStepTrackedDev(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad,
                          DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq);
int OpLionStepTrackedDev(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                         DiondOut m, DiondOut update_sq);
int OpApplyUpdateDev(const DiondOpsCall*, const DiondApplyUpdateScalars*, DiondIn update,
                     DiondIn x_in, DiondOut x);
int OpNormalizeNeurons(const DiondOpsCall*, float w, DiondOut o, DiondOut v);
int OpCopyWithChange(const DiondOpsCall*, DiondIn src, DiondOut dst, DiondOut update_sq);
int OpAllFinite(const DiondOpsCall*, DiondIn x, int32_t* all_finite);
int OpWidenScaleCheckFinite(const DiondOpsCall*, DiondIn x, float scale, DiondOut out,
                            int32_t* all_finite);
int OpFnv1aChecksum(const DiondOpsCall*, DiondIn x, uint64_t* checksum);
// devsession: host registration (ops_memory.cu).
int OpHostRegister(const DiondOpsCall* call, void* ptr, size_t bytes);
int OpHostUnregister(const DiondOpsCall* call, void* ptr);
int OpGraphBeginCapture(const DiondOpsCall* call);
int OpGraphEndCapture(const DiondOpsCall* call, void** graph);
int OpGraphLaunch(const DiondOpsCall* call, void* graph);
void OpGraphDestroy(int device, void* graph);
// asynccopy (ops_memory.cu, ops_reduce.cu)
int OpCopyFromHostAsync(const DiondOpsCall* call, const void* host, void* dst, size_t bytes);
int OpCopyToHostAsync(const DiondOpsCall* call, const void* src, void* host, size_t bytes);
int OpAllFiniteFlag(const DiondOpsCall*, DiondIn x, DiondOut nonfinite);
int OpWidenScaleCheckFiniteFlag(const DiondOpsCall*, DiondIn x, float scale, DiondOut out,
                                DiondOut nonfinite);
// ops_fused.cu (version 7)
int OpDecayScatterWithChange(const DiondOpsCall*, float decay, DiondIn src, int32_t axis,
                             const int64_t* indices, int64_t count, float alpha, DiondOut x,
                             DiondOut update_sq);

// ops_handoff.cu (handoff: device UUIDs, IPC memory handles, VMM fds, interprocess events)
int OpDeviceUuids(const DiondOpsCall* call, uint8_t* uuids, int32_t capacity, int32_t* count);
int OpIpcOpenMemHandle(const DiondOpsCall* call, const uint8_t* handle, void** ptr,
                       uint64_t* bytes);
int OpIpcCloseMemHandle(const DiondOpsCall* call, void* ptr);
int OpVmmImportFd(const DiondOpsCall* call, int32_t fd, uint64_t bytes, uint64_t granularity,
                  void** ptr, void** handle);
int OpVmmUnmap(const DiondOpsCall* call, void* ptr, uint64_t bytes, void* handle);
int OpIpcOpenEvent(const DiondOpsCall* call, const uint8_t* handle, void** event);
int OpEventDestroy(const DiondOpsCall* call, void* event);
int OpStreamWaitEvent(const DiondOpsCall* call, void* event);
int OpEventRecord(const DiondOpsCall* call, void* event);

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_OPS_INTERNAL_H_
