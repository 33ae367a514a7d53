// The CUDA plugin's ops table (DiondOpsApiV1, kernels/cuda/plugin_api.h): the entries of
// ops_*.cu in the table's order. plugin.cc puts it into DiondCudaPluginV1::ops.
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {

const DiondOpsApiV1* OpsApi() {
  static const DiondOpsApiV1 kOps = {
      DIOND_OPS_API_VERSION,
      "cuda",
      &OpAllocate,
      &OpDeallocate,
      &OpCopyFromHost,
      &OpCopyToHost,
      &OpStreamCreate,
      &OpStreamDestroy,
      &OpStreamSynchronize,
      &OpMemoryStats,
      &OpGemm,
      &OpSymmetricProduct,
      &OpSymmetricProductBf16,
      &OpThinQr,
      &OpCholeskyQr,
      &OpRandomizedCholeskyQr,
      &OpFrobeniusNorm,
      &OpAxisNorms,
      &OpTopKByL1Norm,
      &OpIsAllZero,
      &OpGather,
      &OpScatter,
      &OpCopy,
      &OpFill,
      &OpAxpby,
      &OpAddScalar,
      &OpUnary,
      &OpBinary,
      &OpAdamWStep,
      &OpLionStep,
      &OpAddToDiagonal,
      &OpBf16RoundedAxpby,
      &OpAdamWStepTracked,
      &OpLionStepTracked,
      &OpMomentumUpdate,
      &OpApplyUpdate,
      &OpNormalizeNeurons,
      &OpCopyWithChange,
      &OpAllFinite,
      &OpWidenScaleCheckFinite,
      &OpFnv1aChecksum,
      // handoff (ops_handoff.cu)
      &OpDeviceUuids,
      &OpIpcOpenMemHandle,
      &OpIpcCloseMemHandle,
      &OpVmmImportFd,
      &OpVmmUnmap,
      &OpIpcOpenEvent,
      &OpEventDestroy,
      &OpStreamWaitEvent,
      &OpEventRecord,
      // devsession
      &OpHostRegister,
      &OpHostUnregister,
      &OpGraphBeginCapture,
      &OpGraphEndCapture,
      &OpGraphLaunch,
      &OpGraphDestroy,
      // asynccopy
      &OpCopyFromHostAsync,
      &OpCopyToHostAsync,
      &OpAllFiniteFlag,
      &OpWidenScaleCheckFiniteFlag,
      // version 7
      &OpDecayScatterWithChange,
      // version 8 (graph: device-side scalars)
      &OpAdamWStepDev,
      &OpLionStepDev,
      &OpAdamWStepTrackedDev,
      &OpLionStepTrackedDev,
      &OpApplyUpdateDev,
      // version 9
      &OpDeviceHealth,
  };
  return &kOps;
}

}  // namespace diond::cuda
