//! Typed builders for what `CreateSession` declares: parameter groups with every algorithm and
//! option of `proto/diond/v1/optimizer.proto`, and the parameters.
//!
//! ```no_run
//! use diond::{Algorithm, Group, SessionSpec};
//! let spec = SessionSpec::new()
//!     .client_name("my-trainer")
//!     .group(Group::new("matrices", Algorithm::Muon).lr(0.02).mu(0.95).nesterov(true))
//!     .group(Group::new("vectors", Algorithm::Adamw).lr(1e-3).betas(0.9, 0.95))
//!     .param("w1", &[256, 128], "matrices")
//!     .param("b1", &[256], "vectors");
//! ```
//!
//! The builders check nothing themselves: the daemon validates every field before anything is
//! allocated and answers `InvalidArgument` naming the field.

use crate::proto;
pub use crate::proto::{AdjustLr, Algorithm, GradientSync, NonFinitePolicy, Orthogonalizer, Precision, QrMethod};

/// Element type of a tensor as the trainer stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn to_proto(self) -> proto::DType {
        match self {
            Dtype::F32 => proto::DType::DtypeF32,
            Dtype::Bf16 => proto::DType::DtypeBf16,
            Dtype::F16 => proto::DType::DtypeF16,
        }
    }
    /// `None` for DTYPE_UNSPECIFIED or an unknown number.
    pub fn from_proto(v: i32) -> Option<Dtype> {
        match proto::DType::from_i32(v) {
            Some(proto::DType::DtypeF32) => Some(Dtype::F32),
            Some(proto::DType::DtypeBf16) => Some(Dtype::Bf16),
            Some(proto::DType::DtypeF16) => Some(Dtype::F16),
            _ => None,
        }
    }
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// Setters for every field of `Hyperparameters`, shared by [`Group`] and [`Hyperparameters`].
macro_rules! hyperparameter_setters {
    () => {
        pub fn lr(mut self, v: f64) -> Self {
            self.hp_mut().lr = Some(v);
            self
        }
        pub fn mu(mut self, v: f64) -> Self {
            self.hp_mut().mu = Some(v);
            self
        }
        pub fn beta1(mut self, v: f64) -> Self {
            self.hp_mut().beta1 = Some(v);
            self
        }
        pub fn beta2(mut self, v: f64) -> Self {
            self.hp_mut().beta2 = Some(v);
            self
        }
        /// `beta1` and `beta2` (the reference's `betas`).
        pub fn betas(self, beta1: f64, beta2: f64) -> Self {
            self.beta1(beta1).beta2(beta2)
        }
        pub fn weight_decay(mut self, v: f64) -> Self {
            self.hp_mut().weight_decay = Some(v);
            self
        }
        pub fn epsilon(mut self, v: f64) -> Self {
            self.hp_mut().epsilon = Some(v);
            self
        }
        pub fn nesterov(mut self, v: bool) -> Self {
            self.hp_mut().nesterov = Some(v);
            self
        }
        pub fn cautious_wd(mut self, v: bool) -> Self {
            self.hp_mut().cautious_wd = Some(v);
            self
        }
        pub fn adjust_lr(mut self, v: AdjustLr) -> Self {
            self.hp_mut().adjust_lr = v as i32;
            self
        }
        pub fn orthogonalizer(mut self, v: Orthogonalizer) -> Self {
            self.hp_mut().orthogonalizer = v as i32;
            self
        }
        /// NorMuon and Dion3's second moment decay.
        pub fn muon_beta2(mut self, v: f64) -> Self {
            self.hp_mut().muon_beta2 = Some(v);
            self
        }
        /// Dion's rank as a fraction of min(rows, cols).
        pub fn rank_fraction(mut self, v: f64) -> Self {
            self.hp_mut().rank_fraction = Some(v);
            self
        }
        pub fn rank_multiple_of(mut self, v: i64) -> Self {
            self.hp_mut().rank_multiple_of = Some(v);
            self
        }
        /// Dion2 and Dion3's selected fraction.
        pub fn fraction(mut self, v: f64) -> Self {
            self.hp_mut().fraction = Some(v);
            self
        }
        /// Dion2's error-feedback decay.
        pub fn ef_decay(mut self, v: f64) -> Self {
            self.hp_mut().ef_decay = Some(v);
            self
        }
        /// Dion's randomized Cholesky-QR oversampling.
        pub fn oversample(mut self, v: f64) -> Self {
            self.hp_mut().oversample = Some(v);
            self
        }
        /// Dion's orthonormalization of P: RCQR (default), Householder QR or Cholesky QR.
        pub fn qr_method(mut self, v: QrMethod) -> Self {
            self.hp_mut().qr_method = v as i32;
            self
        }
        /// Dion with Cholesky QR: the steps that still use RCQR.
        pub fn cqr_warmup_steps(mut self, v: i64) -> Self {
            self.hp_mut().cqr_warmup_steps = Some(v);
            self
        }
    };
}

/// A change of hyperparameters for `Session::set_hyperparameters`: only the fields set here
/// change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hyperparameters(pub proto::Hyperparameters);

impl Hyperparameters {
    pub fn new() -> Hyperparameters {
        Hyperparameters::default()
    }
    fn hp_mut(&mut self) -> &mut proto::Hyperparameters {
        &mut self.0
    }
    hyperparameter_setters!();
}

/// One parameter group: an algorithm, its hyperparameters (unset ones take the reference
/// default of the algorithm) and the group options.
#[derive(Clone, Debug, PartialEq)]
pub struct Group(pub proto::ParameterGroup);

impl Group {
    pub fn new(name: &str, algorithm: Algorithm) -> Group {
        Group(proto::ParameterGroup {
            name: name.to_string(),
            algorithm: algorithm as i32,
            hyperparameters: Some(proto::Hyperparameters::default()),
            ..Default::default()
        })
    }
    fn hp_mut(&mut self) -> &mut proto::Hyperparameters {
        self.0.hyperparameters.get_or_insert_with(Default::default)
    }
    hyperparameter_setters!();

    /// Orthogonalize each of `n` row blocks (attention heads) separately; 0 = off.
    pub fn num_heads(mut self, n: i64) -> Self {
        self.0.num_heads = n;
        self
    }
    /// Orthogonalize these row blocks separately (they must sum to the rows); empty = off.
    pub fn split_sizes(mut self, sizes: &[i64]) -> Self {
        self.0.split_sizes = sizes.to_vec();
        self
    }
    /// Treat >2-D tensors as (shape[0], prod(rest)) matrices.
    pub fn flatten(mut self, v: bool) -> Self {
        self.0.flatten = v;
        self
    }
    pub fn precision(mut self, v: Precision) -> Self {
        self.0.precision = v as i32;
        self
    }
    /// Seed of Dion's initial Q.
    pub fn seed(mut self, v: u64) -> Self {
        self.0.seed = v;
        self
    }
    pub fn name(&self) -> &str {
        &self.0.name
    }
}

/// Everything `CreateSession` declares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionSpec(pub proto::CreateSessionRequest);

impl SessionSpec {
    pub fn new() -> SessionSpec {
        SessionSpec::default()
    }
    pub fn group(mut self, g: Group) -> Self {
        self.0.groups.push(g.0);
        self
    }
    /// An fp32 parameter of `shape` in group `group`.
    pub fn param(self, name: &str, shape: &[i64], group: &str) -> Self {
        self.param_with_dtype(name, shape, Dtype::F32, group)
    }
    pub fn param_with_dtype(mut self, name: &str, shape: &[i64], dtype: Dtype, group: &str) -> Self {
        self.0.parameters.push(proto::ParameterSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: dtype.to_proto() as i32,
            group: group.to_string(),
        });
        self
    }
    pub fn gradient_sync(mut self, v: GradientSync) -> Self {
        self.0.gradient_sync = v as i32;
        self
    }
    pub fn non_finite_policy(mut self, v: NonFinitePolicy) -> Self {
        self.0.non_finite_policy = v as i32;
        self
    }
    /// The daemon keeps fp32 master weights of bf16/f16 parameters.
    pub fn fp32_master_weights(mut self, v: bool) -> Self {
        self.0.fp32_master_weights = v;
        self
    }
    /// Free text shown in logs and `ListSessions`.
    pub fn client_name(mut self, v: &str) -> Self {
        self.0.client_name = v.to_string();
        self
    }
    /// The world session all ranks' trainers share (docs/DISTRIBUTED.md); empty = local.
    pub fn world_key(mut self, v: &str) -> Self {
        self.0.world_key = v.to_string();
        self
    }
    pub fn request(&self) -> &proto::CreateSessionRequest {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_sets_exactly_the_fields_asked_for() {
        let g = Group::new("g", Algorithm::Dion)
            .lr(0.01)
            .betas(0.8, 0.9)
            .rank_fraction(0.5)
            .rank_multiple_of(8)
            .oversample(1.5)
            .adjust_lr(AdjustLr::RmsNorm)
            .orthogonalizer(Orthogonalizer::NewtonSchulz)
            .num_heads(4)
            .split_sizes(&[2, 2])
            .flatten(true)
            .precision(Precision::Bf16Reference)
            .seed(42);
        let hp = g.0.hyperparameters.clone().unwrap();
        assert_eq!(hp.lr, Some(0.01));
        assert_eq!((hp.beta1, hp.beta2), (Some(0.8), Some(0.9)));
        assert_eq!(hp.rank_fraction, Some(0.5));
        assert_eq!(hp.rank_multiple_of, Some(8));
        assert_eq!(hp.oversample, Some(1.5));
        assert_eq!(hp.mu, None);
        assert_eq!(hp.weight_decay, None);
        assert_eq!(hp.adjust_lr, AdjustLr::RmsNorm as i32);
        assert_eq!(hp.orthogonalizer, Orthogonalizer::NewtonSchulz as i32);
        assert_eq!(g.0.algorithm, Algorithm::Dion as i32);
        assert_eq!((g.0.num_heads, g.0.split_sizes.clone(), g.0.flatten, g.0.seed), (4, vec![2, 2], true, 42));
        assert_eq!(g.0.precision, Precision::Bf16Reference as i32);

        let s = SessionSpec::new()
            .group(g)
            .param("w", &[4, 3], "g")
            .param_with_dtype("h", &[2], Dtype::Bf16, "g")
            .non_finite_policy(NonFinitePolicy::Error)
            .gradient_sync(GradientSync::Average)
            .fp32_master_weights(true)
            .client_name("t")
            .world_key("k");
        let r = s.request();
        assert_eq!(r.parameters.len(), 2);
        assert_eq!(r.parameters[1].dtype, proto::DType::DtypeBf16 as i32);
        assert_eq!(r.parameters[0].shape, vec![4, 3]);
        assert_eq!(r.non_finite_policy, NonFinitePolicy::Error as i32);
        assert_eq!(r.gradient_sync, GradientSync::Average as i32);
        assert!(r.fp32_master_weights);
        assert_eq!((r.client_name.as_str(), r.world_key.as_str()), ("t", "k"));

        let u = Hyperparameters::new().lr(0.5).muon_beta2(0.9).fraction(0.25).ef_decay(0.9).epsilon(1e-6);
        assert_eq!(u.0.lr, Some(0.5));
        assert_eq!(u.0.muon_beta2, Some(0.9));
        assert_eq!((u.0.fraction, u.0.ef_decay, u.0.epsilon), (Some(0.25), Some(0.9), Some(1e-6)));
        assert_eq!(u.0.nesterov, None);
    }
}
