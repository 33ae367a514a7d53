//! Every public golden vector (tests/conformance/vectors) through the daemon with this crate,
//! over shared memory and over Push/Pull streaming, in fp32 and (for the algorithms that have
//! one) the bf16_reference precision.
//!
//! Two independent expectations:
//! - bit for bit, the C++ in-process replay of the same vector: `diond-golden-replay` (built
//!   with the daemon; $DIOND_GOLDEN_REPLAY, default next to the daemon binary) runs the
//!   GroupOptimizer path in its own process from the C++ mapping of the vector's metadata
//!   (tests/service/golden_case.cc), while this file maps the metadata onto a `SessionSpec`
//!   itself. Equality checks the Rust builders, framing, chunking and shm views end to end;
//! - within the file's own tolerances, the stored reference trajectory (as diond-conformance
//!   checks it), so that both sides cannot agree on the wrong optimizer.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_same_bits, rel_fro, repo_root, temp_dir, Daemon, Safetensors};
use diond::{AdjustLr, Algorithm, Client, Group, Orthogonalizer, Precision, QrMethod, SessionSpec};

fn vectors_dir() -> PathBuf {
    repo_root().join("tests/conformance/vectors")
}

fn vector_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(vectors_dir())
        .expect("tests/conformance/vectors")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().map_or(false, |e| e == "safetensors"))
        .collect();
    v.sort();
    v
}

fn replay_binary() -> PathBuf {
    match std::env::var_os("DIOND_GOLDEN_REPLAY") {
        Some(p) => PathBuf::from(p),
        None => common::diond_binary().with_file_name("diond-golden-replay"),
    }
}

/// The vector's algorithm, and whether it has a bf16 path (ALGORITHMS.md).
fn algorithm(name: &str) -> (Algorithm, bool) {
    match name {
        "muon" => (Algorithm::Muon, true),
        "normuon" => (Algorithm::Normuon, true),
        "dion" | "dion_reference" => (Algorithm::Dion, false),
        "dion2" => (Algorithm::Dion2, true),
        "nordion2" => (Algorithm::Dion3, true),
        "adamw" => (Algorithm::Adamw, false),
        "lion" => (Algorithm::Lion, false),
        other => panic!("unknown algorithm '{other}'"),
    }
}

/// The group a trainer would declare for the vector's metadata (upstream constructor keyword
/// arguments and param-group options, tests/conformance/README).
fn group(md: &BTreeMap<String, String>, precision: Precision) -> (Group, bool) {
    let (algo, bf16) = algorithm(&md["algorithm"]);
    let mut g = Group::new("g", algo).precision(precision);
    let hp: serde_json::Value = serde_json::from_str(&md["hyperparameters"]).unwrap();
    for (k, v) in hp.as_object().unwrap() {
        let f = || v.as_f64().unwrap_or_else(|| panic!("{k} is not a number"));
        let b = || v.as_bool().unwrap_or_else(|| panic!("{k} is not a bool"));
        g = match k.as_str() {
            "lr" => g.lr(f()),
            "mu" => g.mu(f()),
            "weight_decay" => g.weight_decay(f()),
            "epsilon" => g.epsilon(f()),
            "muon_beta2" => g.muon_beta2(f()),
            "fraction" => g.fraction(f()),
            "ef_decay" => g.ef_decay(f()),
            "rank_fraction" => g.rank_fraction(f()),
            "rank_multiple_of" => g.rank_multiple_of(f() as i64),
            "nesterov" => g.nesterov(b()),
            "cautious_wd" => g.cautious_wd(b()),
            "flatten" => g.flatten(b()),
            "betas" => {
                let a = v.as_array().unwrap();
                g.betas(a[0].as_f64().unwrap(), a[1].as_f64().unwrap())
            }
            "adjust_lr" => g.adjust_lr(match v.as_str() {
                None => AdjustLr::None,
                Some("spectral_norm") => AdjustLr::SpectralNorm,
                Some("rms_norm") => AdjustLr::RmsNorm,
                Some("none") => AdjustLr::None,
                Some(o) => panic!("adjust_lr {o}"),
            }),
            "use_polar_express" => {
                g.orthogonalizer(if b() { Orthogonalizer::PolarExpress } else { Orthogonalizer::NewtonSchulz })
            }
            "use_triton" | "use_gram_newton_schulz" | "triton_post_ortho" => {
                assert!(!b(), "{k}=true has no CPU equivalent");
                g
            }
            // No effect on a single-device run (kernels/optim/conformance/runner.cc).
            "qr_method" => g.qr_method(match v.as_str() {
                Some("rcqr") => QrMethod::Rcqr,
                Some("qr") => QrMethod::Qr,
                Some("cqr") => QrMethod::Cqr,
                o => panic!("qr_method {o:?}"),
            }),
            "cqr_warmup_steps" => g.cqr_warmup_steps(f() as i64),
            "rcqr_oversample" => g.oversample(f()),
            "power_iters" | "selection_scope" | "verbose" => g,
            other => panic!("hyperparameter '{other}' is not mapped"),
        };
    }
    if let Some(opts) = md.get("param_group_options") {
        let o: serde_json::Value = serde_json::from_str(opts).unwrap();
        for (k, v) in o.as_object().unwrap() {
            if k == "algorithm" || v.is_null() {
                continue;
            }
            g = match k.as_str() {
                "num_heads" => g.num_heads(v.as_i64().unwrap()),
                "split_sizes" => {
                    g.split_sizes(&v.as_array().unwrap().iter().map(|s| s.as_i64().unwrap()).collect::<Vec<_>>())
                }
                other => panic!("group option '{other}' is not mapped"),
            };
        }
    }
    (g, bf16)
}

struct Case {
    file: String,
    v: Safetensors,
    steps: usize,
    shape: Vec<i64>,
    state_init: Vec<(String, Vec<u8>)>, // "w/state.<name>" -> bytes
}

impl Case {
    fn load(path: &Path) -> Case {
        let v = Safetensors::read(path);
        let steps: usize = v.metadata["T"].parse().unwrap();
        let shape = v.tensors["param.init"].0.clone();
        let mut state_init = Vec::new();
        for (name, (_, vals)) in &v.tensors {
            if let Some(s) = name.strip_prefix("state.").and_then(|n| n.strip_suffix(".init")) {
                state_init.push((format!("w/state.{s}"), diond::tensor::f32_bytes(vals)));
            }
        }
        Case { file: path.file_name().unwrap().to_string_lossy().into_owned(), v, steps, shape, state_init }
    }

    fn spec(&self, precision: Precision) -> SessionSpec {
        SessionSpec::new().client_name(&self.file).group(group(&self.v.metadata, precision).0).param(
            "w",
            &self.shape,
            "g",
        )
    }

    fn initial(&self) -> Vec<(&str, Vec<u8>)> {
        let mut t = vec![("w", diond::tensor::f32_bytes(self.v.get("param.init")))];
        for (n, b) in &self.state_init {
            t.push((n.as_str(), b.clone()));
        }
        t
    }

    fn tol(&self, name: &str) -> Option<f64> {
        self.v.metadata.get(&format!("tolerance_{name}")).map(|s| s.parse().unwrap())
    }
}

/// The C++ in-process trajectory of `case` in `mode`.
fn cpp_replay(case: &Path, mode: &str, dir: &Path) -> Safetensors {
    let out = dir.join(format!("{}.{mode}.safetensors", case.file_stem().unwrap().to_string_lossy()));
    let bin = replay_binary();
    let r = Command::new(&bin)
        .arg(mode)
        .arg(case)
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (built with the daemon): {e}", bin.display()));
    assert!(r.status.success(), "{} {mode} {}: {}", bin.display(), case.display(), String::from_utf8_lossy(&r.stderr));
    Safetensors::read(&out)
}

fn check_state(what: &str, state: &diond::TensorMap, cpp: &Safetensors, params: &[f32]) {
    assert_same_bits(&state["w"].to_f32().unwrap(), params, &format!("{what}: GetState parameters"));
    let mut n = 0;
    for (name, (_, vals)) in &cpp.tensors {
        if let Some(s) = name.strip_prefix("state.") {
            let got = state.get(&format!("w/state.{s}")).unwrap_or_else(|| panic!("{what}: no state {s}"));
            assert_same_bits(&got.to_f32().unwrap(), vals, &format!("{what}: state {s}"));
            n += 1;
        }
    }
    assert_eq!(state.len(), n + 1, "{what}: tensors {:?}", state.keys().collect::<Vec<_>>());
}

fn run_over_shm(client: &Client, c: &Case, precision: Precision, cpp: &Safetensors, what: &str) -> Vec<Vec<f32>> {
    let mut s = client.create_session(&c.spec(precision)).unwrap_or_else(|e| panic!("{what}: {e}"));
    s.attach_shm().unwrap();
    let init = c.initial();
    let refs: Vec<(&str, &[u8])> = init.iter().map(|(n, b)| (*n, b.as_slice())).collect();
    s.set_state(&refs).unwrap();
    assert_same_bits(
        s.arena().unwrap().param("w").unwrap(),
        c.v.get("param.init"),
        &format!("{what}: initial weights in shm"),
    );
    let mut traj = Vec::new();
    for t in 1..=c.steps {
        s.arena_mut().unwrap().grad_mut("w").unwrap().copy_from_slice(c.v.get(&format!("grad.{t}")));
        let r = s.step(t as i64).unwrap_or_else(|e| panic!("{what}: step {t}: {e}"));
        assert!(!r.skipped, "{what}: step {t} skipped");
        let p = s.arena().unwrap().param("w").unwrap().to_vec();
        assert_same_bits(&p, cpp.get(&format!("param.{t}")), &format!("{what}: shm params after step {t} vs C++"));
        traj.push(p);
    }
    check_state(what, &s.get_state(true).unwrap(), cpp, traj.last().unwrap());
    s.close().unwrap();
    traj
}

fn run_over_streams(client: &Client, c: &Case, precision: Precision, cpp: &Safetensors, what: &str) {
    let mut s = client.create_session(&c.spec(precision)).unwrap();
    // Odd chunk sizes (multiples of 4 that divide no tensor) exercise reassembly both ways.
    s.set_chunk_bytes(1028);
    let init = c.initial();
    let refs: Vec<(&str, &[u8])> = init.iter().map(|(n, b)| (*n, b.as_slice())).collect();
    s.set_state(&refs).unwrap();
    for t in 1..=c.steps {
        s.set_chunk_bytes(2052);
        let g = c.v.get(&format!("grad.{t}"));
        let pushed = s.push_gradients(&[("w", g)]).unwrap();
        assert_eq!(pushed.bytes_received, (g.len() * 4) as i64);
        s.step(t as i64).unwrap_or_else(|e| panic!("{what}: step {t}: {e}"));
        s.set_chunk_bytes(3000);
        let pulled = s.pull_parameters(&[]).unwrap();
        assert_same_bits(
            &pulled["w"].to_f32().unwrap(),
            cpp.get(&format!("param.{t}")),
            &format!("{what}: pulled params after step {t} vs C++"),
        );
    }
    check_state(what, &s.get_state(true).unwrap(), cpp, cpp.get(&format!("param.{}", c.steps)));
    s.close().unwrap();
}

/// The golden checks of diond-conformance on this trajectory.
fn check_against_golden(c: &Case, bf16_algo: bool, precision: Precision, traj: &[Vec<f32>], what: &str) -> usize {
    let mut checks = 0;
    if !bf16_algo || precision == Precision::Bf16Reference {
        let worst = (1..=c.steps).map(|t| rel_fro(&traj[t - 1], c.v.get(&format!("param.{t}")))).fold(0.0, f64::max);
        let tol = c.tol("param_relfro").expect("tolerance_param_relfro");
        assert!(worst <= tol, "{what}: max_t relF(p_t, param.t) = {worst:e} > {tol:e}");
        checks += 1;
    }
    let f64_final = format!("param_f64.{}", c.steps);
    if (!bf16_algo || precision == Precision::Fp32) && c.v.tensors.contains_key(&f64_final) {
        if let Some(tol) = c.tol("param_f64_final_relfro") {
            let e = rel_fro(traj.last().unwrap(), c.v.get(&f64_final));
            assert!(e <= tol, "{what}: relF(p_T, param_f64.T) = {e:e} > {tol:e}");
            checks += 1;
        }
    }
    checks
}

#[test]
fn every_public_vector_is_in_the_manifest() {
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo_root().join("tests/conformance/manifest.json")).unwrap())
            .unwrap();
    let mut listed: Vec<String> =
        manifest["cases"].as_array().unwrap().iter().map(|c| c["file"].as_str().unwrap().to_string()).collect();
    listed.sort();
    let present: Vec<String> =
        vector_files().iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert!(!present.is_empty());
    assert_eq!(present, listed);
}

#[test]
fn every_public_vector_through_the_daemon_equals_the_cpp_in_process_replay() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let out = temp_dir("replay");
    let files = vector_files();
    assert!(!files.is_empty());
    let (mut runs, mut golden_checks) = (0, 0);
    for path in &files {
        let c = Case::load(path);
        let (_, bf16_algo) = group(&c.v.metadata, Precision::Fp32);
        let mut modes = vec![(Precision::Fp32, "fp32")];
        if bf16_algo {
            modes.push((Precision::Bf16Reference, "bf16_reference"));
        }
        for (precision, mode) in modes {
            let what = format!("{} [{mode}]", c.file);
            let cpp = cpp_replay(path, mode, &out);
            let traj = run_over_shm(&client, &c, precision, &cpp, &format!("{what} shm"));
            run_over_streams(&client, &c, precision, &cpp, &format!("{what} streams"));
            golden_checks += check_against_golden(&c, bf16_algo, precision, &traj, &what);
            runs += 1;
        }
    }
    eprintln!("{} vectors, {runs} (vector, precision) runs, {golden_checks} golden checks", files.len());
    assert!(golden_checks >= files.len(), "some vector had no golden check");
    assert!(client.list_sessions().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&out);
}
