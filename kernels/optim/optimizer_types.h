// Plain domain types of the optimizer layer: which update rule a parameter group uses, its
// hyperparameters and options, and per-step overrides. No proto, no gRPC (STYLE.md R2): the
// daemon converts its request messages into these structs at the edge.
//
// The numerical contract of every field is docs/ALGORITHMS.md (cited per field).
// Reference defaults: DefaultHyperparams(kind) returns the constructor defaults of the
// corresponding microsoft/dion class (ALGORITHMS.md §5.1, §6.1, §7.1, §8.1, §9.1, §13).
//
// Thread-safety: plain values.
#ifndef DIOND_KERNELS_OPTIM_OPTIMIZER_TYPES_H_
#define DIOND_KERNELS_OPTIM_OPTIMIZER_TYPES_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace diond::optim {

enum class AlgorithmKind : uint8_t {
  kMuon,      // ALGORITHMS.md §5
  kNorMuon,   // §6
  kDion,      // §9 (dion.dion.Dion; also what "dion_reference" maps to, §10)
  kDion2,     // §7
  kNorDion2,  // §8 (= Dion3)
  kAdamW,     // §13.1, fused semantics (§20.6)
  kLion,      // §13.3
};

// "muon", "normuon", "dion", "dion2", "nordion2", "adamw", "lion".
absl::string_view AlgorithmName(AlgorithmKind kind);
// Accepts the names above plus the aliases "dion3" (NorDion2) and "dion_reference" (Dion; the
// un-batched reference class computes the same single-device numbers, §10). INVALID_ARGUMENT
// for anything else.
absl::StatusOr<AlgorithmKind> ParseAlgorithm(absl::string_view name);
// True for the orthonormal-update algorithms that run a bf16 orthogonalizer upstream (Muon,
// NorMuon, Dion2, NorDion2): the only ones whose numbers depend on Precision.
bool HasBf16Path(AlgorithmKind kind);

// Learning-rate scaling by the matrix shape (§3.9).
enum class AdjustLr : uint8_t {
  kSpectralNorm,  // lr·√(fan_out/fan_in) (reference default)
  kRmsNorm,       // lr·0.2·√max(fan_out, fan_in)
  kNone,          // lr
};
absl::string_view AdjustLrName(AdjustLr a);  // "spectral_norm", "rms_norm", "none"
// Accepts the names above and "null" (the reference's None). INVALID_ARGUMENT otherwise.
absl::StatusOr<AdjustLr> ParseAdjustLr(absl::string_view name);

// Orthogonalizer of the megabatch family (§2.1, §3.1, §3.3).
enum class Orthogonalizer : uint8_t { kPolarExpress, kNewtonSchulz5 };

// How Dion orthonormalizes P (ALGORITHMS.md §9.4 step 6, §10 `orthogonalize`), with the
// reference's names. All three give a thin-QR Q-factor of P (column signs aside) and differ in
// rounding and robustness only.
enum class QrMethod : uint8_t {
  // The reference default: Householder QR when P is square (a == r), otherwise randomized
  // Cholesky QR (R₁ from a Householder QR of a Gaussian sketch S·P, then one Cholesky-QR pass).
  kRcqr,
  // Householder QR (LAPACK geqrf/orgqr, as torch.linalg.qr) at every step.
  kQr,
  // Cholesky QR (R = chol(PᵀP), P·R⁻¹) once the group's step exceeds cqr_warmup_steps, and kRcqr
  // before; a matrix whose Cholesky factorization fails falls back to kRcqr for that step.
  kCqr,
};
absl::string_view QrMethodName(QrMethod m);  // "rcqr", "qr", "cqr"
// Accepts the names above. INVALID_ARGUMENT (naming qr_method and the value) otherwise.
absl::StatusOr<QrMethod> ParseQrMethod(absl::string_view name);

// Numerics of a group (§0, P4).
enum class Precision : uint8_t {
  // Everything in float32, the orthogonalizer included. Matches the reference evaluated in exact
  // arithmetic to float32 accuracy (the conformance "param_f64" checks).
  kFp32,
  // Emulates the reference's bf16 rounding points for the algorithms that have them: U rounded
  // to bf16, bf16 orthogonalizer, Muon scales the bf16 result by the adjusted lr in bf16;
  // NorMuon/Dion2/NorDion2 widen the bf16 result to f32 first (conformance README §3.3).
  // Algorithms without a bf16 path (Dion, AdamW, Lion) compute exactly as kFp32.
  kBf16Reference,
};
absl::string_view PrecisionName(Precision p);  // "fp32", "bf16_reference"
absl::StatusOr<Precision> ParsePrecision(absl::string_view name);

// kBf16Reference only: how the orthogonalizer multiplies its bf16 matrices (both accumulate in
// float32 and round each product once to bf16; docs/CONFORMANCE.md "bf16 matmul engine").
enum class Bf16MatmulEngine : uint8_t {
  // The faster of the two below as the start-up calibration measured it; without one, what
  // PyTorch itself does on this CPU: oneDNN's bf16 matmul where PyTorch routes bf16 matmuls to
  // oneDNN (x86 CPUs with AVX-512 core: AVX512F/BW/VL/DQ, PyTorch's mkldnn_bf16_device_check),
  // the float32 GEMM elsewhere. ResolveBf16Matmul says which one.
  kAuto,
  // The float32 OpenBLAS GEMM of the widened bf16 operands: the stored trajectories' arithmetic
  // (they were made on PyTorch's float32 GEMM), bit for bit on the conformance vectors.
  kFloat32Gemm,
  // oneDNN's bf16 matmul (native bf16 dot products where the CPU has them): PyTorch 2.x's and
  // 1.13's order on AVX-512 CPUs; within the reference's own spread on every vector.
  kOneDnn,
};
absl::string_view Bf16MatmulEngineName(Bf16MatmulEngine e);  // "auto", "float32_gemm", "onednn"
// Accepts the names above. INVALID_ARGUMENT (naming bf16_matmul and the value) otherwise.
absl::StatusOr<Bf16MatmulEngine> ParseBf16MatmulEngine(absl::string_view name);
// kAuto resolved in this process: the engine the start-up calibration measured faster
// (kernels/engine_choice.h; the daemon and diond_bench calibrate), else IsaBf16Matmul(). Both
// engines keep the reference's rounding points. The other values are returned unchanged.
Bf16MatmulEngine ResolveBf16Matmul(Bf16MatmulEngine e);
// kOneDnn iff the CPU has AVX512F, AVX512BW, AVX512VL and AVX512DQ (the check PyTorch makes
// before using oneDNN's bf16 matmul), else kFloat32Gemm.
Bf16MatmulEngine IsaBf16Matmul();

// Every hyperparameter of every algorithm: one member per row of options.def, with its default
// (the row's comment says what it does; ALGORITHMS.md cites the formulas). Values are given in
// double as the caller has them; the update rules round each one to float32 before any
// arithmetic (P1). Fields an algorithm does not read are ignored (and not range-checked) for
// that algorithm; options that change behaviour (nesterov, cautious_wd, adjust_lr,
// orthogonalizer, Dion's QR options) are rejected with INVALID_ARGUMENT when set to a
// non-default value on an algorithm that lacks them, so that no option is silently a no-op
// (OptionRow::elsewhere, kernels/optim/option_table.h).
struct Hyperparams {
#define DIOND_OPTION(name, member, type, default_value, range, algorithms, elsewhere, since) \
  type member = default_value;
#include "kernels/optim/options.def"
#undef DIOND_OPTION
};

// The reference constructor defaults of `kind` (lr 0.01, mu 0.95, betas (0.9, 0.95),
// weight_decay 0.01, epsilon 1e-8, ...). The same struct for every kind today; kept per kind so
// that a future default that differs does not change the API.
Hyperparams DefaultHyperparams(AlgorithmKind kind);

// Shape of one parameter tensor (row-major, dims >= 1 for matrix algorithms).
using ParamShape = std::vector<int64_t>;

struct GroupConfig {
  AlgorithmKind algorithm = AlgorithmKind::kMuon;
  Hyperparams hyperparams;
  // Muon, NorMuon, Dion2, NorDion2 (§14.1): every 2-D parameter [m, n] is treated as num_heads
  // independent [m/num_heads, n] matrices. 1 = off. Must divide m.
  int64_t num_heads = 1;
  // Muon, NorMuon (§14.2): row blocks orthogonalized separately, each scaled so that its lr
  // matches its own shape (§3.8). Empty = off; else >= 2 positive sizes summing to m.
  std::vector<int64_t> split_sizes;
  // Muon, NorMuon, Dion2, NorDion2 (§14.3): a parameter of rank >= 3 is orthogonalized (and its
  // lr adjusted) as one [shape[0], ∏shape[1:]] matrix instead of a batch of its trailing
  // matrices. Done per parameter, as the reference intends, not as its stacked path does (P16).
  bool flatten = false;
  Precision precision = Precision::kFp32;
  // kBf16Reference's bf16 matmuls (above). Ignored in kFp32 and by the algorithms without a bf16
  // path (Dion, AdamW, Lion).
  Bf16MatmulEngine bf16_matmul = Bf16MatmulEngine::kAuto;
  // Dion: seed of the N(0, 1) initial Q (P12). Q can be replaced through SetState("Q").
  uint64_t seed = 0;
};

// The compact form of a step's updates, for a daemon world where one worker (the owner) runs a
// parameter's update and the others reproduce it without its optimizer state (the daemon's
// docs/DISTRIBUTED.md; GroupOptimizer's CapturedUpdateSize / ApplyCapturedUpdate).
struct StepCapture {
  // Per parameter of the group: filled by Step for the parameters that had a gradient and whose
  // algorithm and shape have a compact form (CapturedUpdateSize > 0); empty otherwise.
  std::vector<std::vector<float>> payload;
};

// Per-step overrides (e.g. an lr schedule driven by the daemon's client).
struct StepOptions {
  std::optional<double> lr;            // replaces hyperparams.lr for this step; >= 0
  std::optional<double> weight_decay;  // replaces hyperparams.weight_decay for this step; >= 0
  // The 1-based number of this step as the reference's group["step"] counts it, for the rules
  // whose arithmetic depends on it (Dion's cqr_warmup_steps; the randomized-QR sketch is drawn
  // from it). The daemon passes the session's step index. Unset: steps_taken() + 1. >= 1.
  std::optional<int64_t> step;
  // When set, Step also reports the compact form of its updates here. Null (the default)
  // changes nothing: the numbers are the same either way.
  StepCapture* capture = nullptr;
  // Dion's compressed data-parallel sync (ALGORITHMS.md §9.7): when set, P = B·Q and R = Bᵀ·P of
  // every shape bucket are replaced by their average over the data-parallel replicas through
  // this function, called twice per bucket (P, then R; each the bucket's matrices stacked), in
  // bucket order. Each replica keeps its own momentum; P, R, Q and the weight update come out
  // identical on every replica. A bucket's B ≡ 0 case is then decided on the averaged P.
  // Other algorithms ignore it. Empty (the default) changes nothing.
  std::function<absl::Status(absl::Span<float>)> replica_average;
  // Where replica_average reads and writes: false (the default), host memory (a device Context
  // reads the buffer back and writes it again: two sync points); true, the memory of the step's
  // Context (a device collective, e.g. NCCL, averages it in place).
  bool replica_average_on_device = false;
  // The caller's promise that nothing can fail between Stage and CommitStagedState and that the
  // params and grads memory cannot fault (e.g. sealed memfd or the daemon's own memory, in a
  // local session). In-place rules (AdamW, Lion) then step params and state directly in Stage,
  // reading and writing each byte once, and DiscardStagedStep can no longer undo them; without
  // it they step staged copies (GroupOptimizer::Step sets it: its phases run back to back).
  bool in_place = false;
};

// State tensor names, exactly as the reference's state dict and the conformance vectors.
inline constexpr absl::string_view kStateMomentum = "momentum";
inline constexpr absl::string_view kStateVarianceNeuron = "variance_neuron";
inline constexpr absl::string_view kStateQ = "Q";
inline constexpr absl::string_view kStateVariance = "variance";
inline constexpr absl::string_view kStateStepDev = "step_dev";

// The state names of `kind`, in the reference's order.
std::vector<std::string> StateNames(AlgorithmKind kind);

// Dion's rank for an m×n matrix (§9.3, P2): r = mult·⌈(frac·min(m,n))/mult⌉ in IEEE double,
// then min(r, m, n).
int64_t DionRank(int64_t m, int64_t n, double rank_fraction, int64_t rank_multiple_of);

// Rows of Dion's randomized-QR sketch for rank r (§9.4 step 6): 128·⌈oversample·r/128⌉ in IEEE
// double, as the reference computes it.
int64_t RcqrSketchRows(int64_t r, double oversample);
// Upper bound of rcqr_oversample accepted by validation (the sketch is k×a floats).
inline constexpr double kMaxRcqrOversample = 16.0;

// Dion2/NorDion2 selection count for L slices (§7.3 step 1, P2): max(1, ⌈fraction·L⌉) in IEEE
// double, capped at L.
int64_t SelectionCount(int64_t length, double fraction);

}  // namespace diond::optim

#endif  // DIOND_KERNELS_OPTIM_OPTIMIZER_TYPES_H_
