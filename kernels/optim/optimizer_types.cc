#include "kernels/optim/optimizer_types.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/engine_choice.h"

namespace diond::optim {

absl::string_view AlgorithmName(AlgorithmKind kind) {
  switch (kind) {
    case AlgorithmKind::kMuon:
      return "muon";
    case AlgorithmKind::kNorMuon:
      return "normuon";
    case AlgorithmKind::kDion:
      return "dion";
    case AlgorithmKind::kDion2:
      return "dion2";
    case AlgorithmKind::kNorDion2:
      return "nordion2";
    case AlgorithmKind::kAdamW:
      return "adamw";
    case AlgorithmKind::kLion:
      return "lion";
  }
  return "unknown";
}

absl::StatusOr<AlgorithmKind> ParseAlgorithm(absl::string_view name) {
  if (name == "muon") return AlgorithmKind::kMuon;
  if (name == "normuon") return AlgorithmKind::kNorMuon;
  if (name == "dion" || name == "dion_reference") return AlgorithmKind::kDion;
  if (name == "dion2") return AlgorithmKind::kDion2;
  if (name == "nordion2" || name == "dion3") return AlgorithmKind::kNorDion2;
  if (name == "adamw") return AlgorithmKind::kAdamW;
  if (name == "lion") return AlgorithmKind::kLion;
  return absl::InvalidArgumentError(absl::StrCat("unknown algorithm '", name, "'"));
}

bool HasBf16Path(AlgorithmKind kind) {
  return kind == AlgorithmKind::kMuon || kind == AlgorithmKind::kNorMuon ||
         kind == AlgorithmKind::kDion2 || kind == AlgorithmKind::kNorDion2;
}

absl::string_view AdjustLrName(AdjustLr a) {
  switch (a) {
    case AdjustLr::kSpectralNorm:
      return "spectral_norm";
    case AdjustLr::kRmsNorm:
      return "rms_norm";
    case AdjustLr::kNone:
      return "none";
  }
  return "unknown";
}

absl::StatusOr<AdjustLr> ParseAdjustLr(absl::string_view name) {
  if (name == "spectral_norm") return AdjustLr::kSpectralNorm;
  if (name == "rms_norm") return AdjustLr::kRmsNorm;
  if (name == "none" || name == "null") return AdjustLr::kNone;
  return absl::InvalidArgumentError(absl::StrCat("unknown adjust_lr '", name, "'"));
}

int64_t RcqrSketchRows(int64_t r, double oversample) {
  return static_cast<int64_t>(std::ceil(oversample * static_cast<double>(r) / 128.0)) * 128;
}

absl::string_view QrMethodName(QrMethod m) {
  switch (m) {
    case QrMethod::kRcqr:
      return "rcqr";
    case QrMethod::kQr:
      return "qr";
    case QrMethod::kCqr:
      return "cqr";
  }
  return "unknown";
}

absl::StatusOr<QrMethod> ParseQrMethod(absl::string_view name) {
  if (name == "rcqr") return QrMethod::kRcqr;
  if (name == "qr") return QrMethod::kQr;
  if (name == "cqr") return QrMethod::kCqr;
  return absl::InvalidArgumentError(absl::StrCat("unknown qr_method '", name.substr(0, 64),
                                                 "' (expected 'rcqr', 'qr' or 'cqr')"));
}

absl::string_view PrecisionName(Precision p) {
  return p == Precision::kFp32 ? "fp32" : "bf16_reference";
}

absl::StatusOr<Precision> ParsePrecision(absl::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16_reference") return Precision::kBf16Reference;
  return absl::InvalidArgumentError(absl::StrCat("unknown precision '", name, "'"));
}

absl::string_view Bf16MatmulEngineName(Bf16MatmulEngine e) {
  switch (e) {
    case Bf16MatmulEngine::kAuto:
      return "auto";
    case Bf16MatmulEngine::kFloat32Gemm:
      return "float32_gemm";
    case Bf16MatmulEngine::kOneDnn:
      return "onednn";
  }
  return "unknown";
}

absl::StatusOr<Bf16MatmulEngine> ParseBf16MatmulEngine(absl::string_view name) {
  if (name == "auto") return Bf16MatmulEngine::kAuto;
  if (name == "float32_gemm") return Bf16MatmulEngine::kFloat32Gemm;
  if (name == "onednn") return Bf16MatmulEngine::kOneDnn;
  return absl::InvalidArgumentError(absl::StrCat(
      "bf16_matmul '", name.substr(0, 64), "' is unknown (want auto, float32_gemm or onednn)"));
}

Bf16MatmulEngine ResolveBf16Matmul(Bf16MatmulEngine e) {
  if (e != Bf16MatmulEngine::kAuto) return e;
  const kernels::AutoEngines measured = kernels::CurrentAutoEngines();
  if (measured.bf16_measured) {
    return measured.bf16_onednn ? Bf16MatmulEngine::kOneDnn : Bf16MatmulEngine::kFloat32Gemm;
  }
  return IsaBf16Matmul();
}

Bf16MatmulEngine IsaBf16Matmul() {
  return kernels::CpuHasOneDnnBf16Matmul() ? Bf16MatmulEngine::kOneDnn
                                           : Bf16MatmulEngine::kFloat32Gemm;
}

Hyperparams DefaultHyperparams(AlgorithmKind kind) {
  (void)kind;
  return Hyperparams{};
}

std::vector<std::string> StateNames(AlgorithmKind kind) {
  switch (kind) {
    case AlgorithmKind::kMuon:
    case AlgorithmKind::kDion2:
    case AlgorithmKind::kLion:
      return {std::string(kStateMomentum)};
    case AlgorithmKind::kNorMuon:
    case AlgorithmKind::kNorDion2:
      return {std::string(kStateMomentum), std::string(kStateVarianceNeuron)};
    case AlgorithmKind::kDion:
      return {std::string(kStateMomentum), std::string(kStateQ)};
    case AlgorithmKind::kAdamW:
      return {std::string(kStateMomentum), std::string(kStateVariance), std::string(kStateStepDev)};
  }
  return {};
}

int64_t DionRank(int64_t m, int64_t n, double rank_fraction, int64_t rank_multiple_of) {
  const double mult = static_cast<double>(rank_multiple_of);
  const double raw = rank_fraction * static_cast<double>(std::min(m, n));
  const int64_t r = rank_multiple_of * static_cast<int64_t>(std::ceil(raw / mult));
  return std::min({r, m, n});
}

int64_t SelectionCount(int64_t length, double fraction) {
  const int64_t k =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * static_cast<double>(length))));
  return std::min(k, length);
}

}  // namespace diond::optim
