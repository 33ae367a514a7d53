//! Every RPC of diond.v1.Optimizer through the crate, against the real daemon. The expectations
//! are properties of the service contract (optimizer.proto): a step is the same bytes whichever
//! transport carried the tensors, a replayed step answers from the record, lr = 0 changes
//! nothing, a checkpoint resumes to the same bytes, and so on.

mod common;

use std::collections::BTreeMap;

use common::{assert_same_bits, leftover_segments, temp_dir, Daemon};
use diond::{proto, Algorithm, Client, Code, Group, Hyperparameters, SessionSpec, StepOptions};

/// Deterministic values in [-1, 1) (a 64-bit LCG), a pure function of (seed, n).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
        })
        .collect()
}

fn muon_spec(name: &str) -> SessionSpec {
    SessionSpec::new()
        .client_name(name)
        .group(Group::new("m", Algorithm::Muon).lr(0.02).weight_decay(0.01))
        .group(Group::new("a", Algorithm::Adamw).lr(1e-3).betas(0.9, 0.95))
        .param("w", &[32, 24], "m")
        .param("b", &[24], "a")
}

const W: usize = 32 * 24;
const B: usize = 24;

#[test]
fn shm_session_every_rpc_and_the_step_contract() {
    let d = Daemon::start(&[], false);
    let client = d.client();

    // CreateSession: the layout the contract promises.
    let mut s = client.create_session(&muon_spec("rpc-shm")).unwrap();
    let layout = s.layout().clone();
    assert!(!s.id().is_empty());
    assert_eq!(layout.alignment_bytes, 256);
    assert_eq!(layout.layout.len(), 2);
    for t in &layout.layout {
        assert_eq!(t.param_offset_bytes % 256, 0);
        assert_eq!(t.grad_offset_bytes % 256, 0);
        let numel: i64 = t.shape.iter().product();
        assert_eq!(t.size_bytes, numel * 4, "{}", t.name);
    }

    // RegisterRegion (both roles) and SetState: the initial weights land in our shm arena.
    s.attach_shm().unwrap();
    assert_eq!(s.region_ids().len(), 2);
    let w0 = values(1, W);
    let b0 = values(2, B);
    let (wb, bb) = (diond::tensor::f32_bytes(&w0), diond::tensor::f32_bytes(&b0));
    assert_eq!(s.set_state(&[("w", &wb), ("b", &bb)]).unwrap(), 2);
    assert_same_bits(s.arena().unwrap().param("w").unwrap(), &w0, "values");
    assert_same_bits(s.arena().unwrap().param("b").unwrap(), &b0, "values");

    // Step over shm.
    {
        let mut views = s.arena_mut().unwrap().views_mut().unwrap();
        assert_eq!(views.len(), 2);
        for (i, v) in views.iter_mut().enumerate() {
            assert_eq!(v.name, layout.layout[i].name);
            let n = v.grad.len();
            v.grad.copy_from_slice(&values(10 + i as u64, n));
        }
    }
    let r1 = s.step(1).unwrap();
    assert_eq!(r1.step_index, 1);
    assert!(!r1.skipped && !r1.replayed);
    assert!(r1.update_norms["m"] > 0.0 && r1.update_norms["a"] > 0.0, "{:?}", r1.update_norms);
    let w1 = s.arena().unwrap().param("w").unwrap().to_vec();
    assert!(w1 != w0, "step 1 did not move w");

    // The same index again is answered from the record and changes nothing.
    let again = s.step(1).unwrap();
    assert!(again.replayed);
    assert_eq!(again.update_norms, r1.update_norms);
    assert_same_bits(s.arena().unwrap().param("w").unwrap(), &w1, "values");
    // Skipping an index is refused, naming the expected one.
    let e = s.step(3).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains('2'), "{e}");

    // PullParameters (server streaming, small chunks) equals what the daemon wrote to shm.
    s.set_chunk_bytes(100);
    let pulled = s.pull_parameters(&[]).unwrap();
    assert_eq!(pulled.keys().collect::<Vec<_>>(), vec!["b", "w"]);
    assert_same_bits(&pulled["w"].to_f32().unwrap(), &w1, "values");
    assert_eq!(pulled["w"].shape, vec![32, 24]);
    assert_eq!(pulled["w"].dtype, Some(diond::Dtype::F32));
    let only_b = s.pull_parameters(&["b"]).unwrap();
    assert_eq!(only_b.keys().collect::<Vec<_>>(), vec!["b"]);

    // GetState: parameters plus the per-algorithm state tensors.
    let state = s.get_state(true).unwrap();
    assert_same_bits(&state["w"].to_f32().unwrap(), &w1, "values");
    assert!(state.contains_key("w/state.momentum"), "{:?}", state.keys().collect::<Vec<_>>());
    assert!(state.contains_key("b/state.variance"), "{:?}", state.keys().collect::<Vec<_>>());
    let no_params = s.get_state(false).unwrap();
    assert!(!no_params.contains_key("w"));

    // SetHyperparameters: lr = 0 for both groups makes the next step the identity (Muon's
    // decoupled weight decay is scaled by lr too).
    s.set_hyperparameters("m", &Hyperparameters::new().lr(0.0)).unwrap();
    s.set_hyperparameters("a", &Hyperparameters::new().lr(0.0)).unwrap();
    let before = s.pull_parameters(&[]).unwrap();
    s.arena_mut().unwrap().grad_mut("w").unwrap().copy_from_slice(&values(12, W));
    s.step(2).unwrap();
    let after = s.pull_parameters(&[]).unwrap();
    assert!(before == after, "lr 0 changed the weights");
    // ... and a per-step lr override applies just to that step.
    let mut opts = StepOptions::default();
    opts.lr_override = BTreeMap::from([("m".to_string(), 0.02)]);
    let r3 = s.step_with(3, &opts).unwrap();
    assert!(r3.update_norms["m"] > 0.0);
    let after3 = s.pull_parameters(&[]).unwrap();
    assert!(after3["w"] != after["w"], "the lr override did not apply");
    assert!(after3["b"] == after["b"], "group a kept lr 0");

    // ListSessions shows it.
    let listed = client.list_sessions().unwrap();
    let me = listed.iter().find(|i| i.session_id == s.id()).expect("listed");
    assert_eq!(me.client_name, "rpc-shm");
    assert_eq!(me.last_step_index, 3);
    assert_eq!(me.parameters, 2);

    // UnregisterRegion: detached (segments unlinked), the session goes on over streams.
    let (p, g) = s.arena().unwrap().segment_names().unwrap();
    let mine = [p.to_string(), g.to_string()];
    assert!(mine.iter().all(|n| leftover_segments().contains(n)));
    s.detach_shm().unwrap();
    assert!(s.arena().is_none());
    assert!(mine.iter().all(|n| !leftover_segments().contains(n)), "{:?}", leftover_segments());
    // Without a region the daemon holds no weights: they go back in with SetState.
    assert_eq!(s.step(4).unwrap_err().code(), Code::FailedPrecondition);
    assert_eq!(s.set_state_map(&after3).unwrap(), 2);
    s.push_gradients(&[("w", &values(13, W)), ("b", &values(14, B))]).unwrap();
    s.step_with(4, &opts).unwrap(); // group m at lr 0.02 again
    assert!(s.pull_parameters(&["w"]).unwrap()["w"] != after3["w"], "step 4 did not move w");

    // CloseSession.
    let id = s.id().to_string();
    s.close().unwrap();
    assert!(client.list_sessions().unwrap().iter().all(|i| i.session_id != id));
}

#[test]
fn streams_and_shm_give_the_same_bytes_and_drop_closes() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let w0 = values(3, W);
    let b0 = values(4, B);
    let init = [("w", diond::tensor::f32_bytes(&w0)), ("b", diond::tensor::f32_bytes(&b0))];
    let init: Vec<(&str, &[u8])> = init.iter().map(|(n, v)| (*n, v.as_slice())).collect();

    let mut shm = client.create_session(&muon_spec("twin-shm")).unwrap();
    shm.attach_shm().unwrap();
    let (p, g) = shm.arena().unwrap().segment_names().unwrap();
    let mine = [p.to_string(), g.to_string()];
    shm.set_state(&init).unwrap();
    let mut remote = client.create_session(&muon_spec("twin-remote")).unwrap();
    remote.set_chunk_bytes(1028); // divides no tensor: exercises reassembly on the daemon
    remote.set_state(&init).unwrap();
    for step in 1..=4 {
        let gw = values(100 + step as u64, W);
        let gb = values(200 + step as u64, B);
        {
            let a = shm.arena_mut().unwrap();
            a.grad_mut("w").unwrap().copy_from_slice(&gw);
            a.grad_mut("b").unwrap().copy_from_slice(&gb);
        }
        shm.step(step).unwrap();
        let pushed = remote.push_gradients(&[("w", &gw), ("b", &gb)]).unwrap();
        assert_eq!(pushed.bytes_received, ((W + B) * 4) as i64);
        assert!(pushed.chunks >= 3);
        remote.step(step).unwrap();
        let pulled = remote.pull_parameters(&[]).unwrap();
        assert_same_bits(
            &pulled["w"].to_f32().unwrap(),
            shm.arena().unwrap().param("w").unwrap(),
            &format!("step {step}"),
        );
        assert_same_bits(
            &pulled["b"].to_f32().unwrap(),
            shm.arena().unwrap().param("b").unwrap(),
            &format!("step {step}"),
        );
    }
    assert!(shm.get_state(true).unwrap() == remote.get_state(true).unwrap(), "final states differ");
    let ids = [shm.id().to_string(), remote.id().to_string()];
    drop(shm);
    drop(remote);
    let left: Vec<_> = client.list_sessions().unwrap().into_iter().map(|i| i.session_id).collect();
    assert!(ids.iter().all(|id| !left.contains(id)), "dropped sessions still open: {left:?}");
    assert!(mine.iter().all(|n| !leftover_segments().contains(n)), "{:?}", leftover_segments());
}

#[test]
fn tensors_over_4_mib_stream_in_several_chunks() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let rows = 1024i64;
    let cols = 1280i64; // 5 MiB of fp32
    let n = (rows * cols) as usize;
    let spec = SessionSpec::new().group(Group::new("a", Algorithm::Adamw).lr(1e-3)).param("big", &[rows, cols], "a");
    let mut s = client.create_session(&spec).unwrap();
    s.set_chunk_bytes(4 << 20);
    let w0 = values(5, n);
    let wb = diond::tensor::f32_bytes(&w0);
    s.set_state(&[("big", &wb)]).unwrap();
    let g = values(6, n);
    let pushed = s.push_gradients(&[("big", &g)]).unwrap();
    assert_eq!(pushed.bytes_received, (n * 4) as i64);
    assert_eq!(pushed.chunks, 2);
    s.step(1).unwrap();
    let p = s.pull_parameters(&[]).unwrap()["big"].to_f32().unwrap();
    // AdamW's first step moves every weight by about lr (sign of the gradient), weight decay aside.
    let moved = p.iter().zip(&w0).zip(&g).filter(|((a, b), g)| (*a - *b) * g.signum() < 0.0).count();
    assert!(moved > n * 99 / 100, "{moved} of {n} weights moved against their gradient");
    s.close().unwrap();
}

#[test]
fn checkpoint_save_and_load_resume_to_the_same_bytes() {
    let state_dir = temp_dir("state");
    let flag = format!("--state_dir={}", state_dir.display());
    let d = Daemon::start(&[flag.as_str()], false);
    let client = d.client();
    let mut s = client.create_session(&muon_spec("ckpt")).unwrap();
    s.attach_shm().unwrap();
    let w0 = diond::tensor::f32_bytes(&values(7, W));
    s.set_state(&[("w", &w0)]).unwrap();
    let grads = |t: u64| (values(300 + t, W), values(400 + t, B));
    for t in 1..=2 {
        let (gw, gb) = grads(t);
        let a = s.arena_mut().unwrap();
        a.grad_mut("w").unwrap().copy_from_slice(&gw);
        a.grad_mut("b").unwrap().copy_from_slice(&gb);
        s.step(t as i64).unwrap();
    }
    let saved = s.save_checkpoint("").unwrap();
    assert_eq!(saved.step_index, 2);
    assert!(saved.bytes > 0);
    assert!(saved.path.contains(s.id()), "{}", saved.path);
    let at2 = s.get_state(true).unwrap();
    let (gw, gb) = grads(3);
    {
        let a = s.arena_mut().unwrap();
        a.grad_mut("w").unwrap().copy_from_slice(&gw);
        a.grad_mut("b").unwrap().copy_from_slice(&gb);
    }
    s.step(3).unwrap();
    let at3 = s.get_state(true).unwrap();

    let (mut r, last) = client.load_checkpoint(&saved.path).unwrap();
    assert_eq!(last, 2);
    assert_ne!(r.id(), s.id());
    assert!(r.get_state(true).unwrap() == at2, "restored state differs from the saved one");
    r.attach_shm().unwrap();
    assert!(
        r.arena().unwrap().param_bytes("w").unwrap() == at2["w"].data.as_slice(),
        "restored weights not in the new arena"
    );
    // Step 3 on the restored session matches step 3 on the original, bit for bit.
    {
        let a = r.arena_mut().unwrap();
        a.grad_mut("w").unwrap().copy_from_slice(&gw);
        a.grad_mut("b").unwrap().copy_from_slice(&gb);
    }
    r.step(3).unwrap();
    assert!(r.get_state(true).unwrap() == at3, "step 3 after restore differs");
    r.close().unwrap();
    s.close().unwrap();
    let _ = std::fs::remove_dir_all(&state_dir);
}

#[test]
fn tcp_transport_and_the_raw_stubs() {
    // TCP needs a credential (docs/OPERATIONS.md "Security"): a bearer token from a token file.
    let tokens = temp_dir("tokens").join("tokens.txt");
    std::fs::write(&tokens, "rust-test-token-0123456789 rust-tester\n").unwrap();
    let flag = format!("--auth_token_file={}", tokens.display());
    let d = Daemon::start(&[flag.as_str()], true);
    let port = d.tcp_port.expect("the ready file names the TCP port");
    let target = format!("127.0.0.1:{port}");
    // Without the token the daemon refuses the call, with the token it serves it.
    let anonymous = Client::connect(&target).unwrap();
    let refused = anonymous.list_sessions().unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused}");
    let client = Client::builder(&target).bearer_token("rust-test-token-0123456789").connect().unwrap();
    let created = client.rpc().create_session(muon_spec("tcp").request().clone()).unwrap();
    let id = created.session_id.clone();
    let w0 = diond::tensor::f32_bytes(&values(8, W));
    let set = client
        .rpc()
        .set_state(vec![proto::TensorChunk {
            session_id: id.clone(),
            name: "w".into(),
            data: w0.clone(),
            ..Default::default()
        }])
        .unwrap();
    assert_eq!(set.tensors, 1);
    let mut chunks = Vec::new();
    client
        .rpc()
        .pull_parameters(proto::PullParametersRequest { session_id: id.clone(), names: vec![], chunk_bytes: 0 }, |c| {
            chunks.push(c);
            Ok(())
        })
        .unwrap();
    // Each tensor arrives whole (default 4 MiB chunks) with its shape; "w" is what was set.
    assert_eq!(chunks.len(), 2);
    assert!(chunks.iter().find(|c| c.name == "w").unwrap().data == w0);
    for c in &chunks {
        assert_eq!(c.offset_bytes, 0);
        assert_eq!(c.total_bytes as usize, c.data.len());
        assert!(!c.shape.is_empty());
    }
    let listed = client.rpc().list_sessions(proto::ListSessionsRequest {}).unwrap();
    assert!(listed.sessions.iter().any(|i| i.session_id == id && i.client_name == "tcp"));
    client.rpc().close_session(proto::CloseSessionRequest { session_id: id }).unwrap();
}

/// Asynchronous Step (docs/DATA_PLANE.md): three steps queued and collected with wait_step (and
/// one by the next step's `previous`) give the synchronous session's bytes and norms.
#[test]
fn asynchronous_steps_match_synchronous_steps() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let mut sync = client.create_session(&muon_spec("rpc-sync")).unwrap();
    let mut asy = client.create_session(&muon_spec("rpc-async")).unwrap();
    let (wb, bb) = (diond::tensor::f32_bytes(&values(1, W)), diond::tensor::f32_bytes(&values(2, B)));
    for s in [&mut sync, &mut asy] {
        s.attach_shm().unwrap();
        s.set_state(&[("w", &wb), ("b", &bb)]).unwrap();
    }
    let opts = StepOptions { asynchronous: true, ..Default::default() };
    let mut want_prev = None;
    for t in 1..=4i64 {
        if t % 2 == 1 {
            for s in [&mut sync, &mut asy] {
                s.arena_mut().unwrap().grad_mut("w").unwrap().copy_from_slice(&values(10 + t as u64, W));
                s.arena_mut().unwrap().grad_mut("b").unwrap().copy_from_slice(&values(20 + t as u64, B));
            }
        }
        let want = sync.step(t).unwrap();
        let q = asy.step_with(t, &opts).unwrap();
        assert!(q.queued && q.step_index == t, "{q:?}");
        if t % 2 == 1 {
            assert!(q.previous.is_none());
            want_prev = Some(want);
            continue;
        }
        // Step t (same gradients) collected step t-1.
        let prev = q.previous.as_ref().expect("previous");
        assert_eq!(prev.step_index, t - 1);
        assert_eq!(prev.update_norms, want_prev.as_ref().unwrap().update_norms);
        let done = asy.wait_step(0).unwrap();
        assert!(!done.queued && done.step_index == t);
        assert_eq!(done.update_norms, want.update_norms);
        assert_same_bits(asy.arena().unwrap().param("w").unwrap(), sync.arena().unwrap().param("w").unwrap(), "values");
    }
    // With a step queued, GetState is refused, naming it.
    asy.step_with(5, &opts).unwrap();
    let e = asy.get_state(false).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("step 5 was queued"), "{e}");
    assert_eq!(asy.wait_step(5).unwrap().step_index, 5);
    assert!(asy.get_state(false).is_ok());
}

/// max_grad_norm: the daemon's answer carries the norm computed here (in f64, an order of its
/// own), and its weights equal a session given the gradients already multiplied by
/// (f32)(max / (norm + 1e-6)), bit for bit; a max above the norm changes nothing.
#[test]
fn the_daemon_clip_equals_gradients_clipped_by_the_trainer() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let mut clip = client.create_session(&muon_spec("rpc-clip")).unwrap();
    let mut pre = client.create_session(&muon_spec("rpc-preclipped")).unwrap();
    let (wb, bb) = (diond::tensor::f32_bytes(&values(1, W)), diond::tensor::f32_bytes(&values(2, B)));
    for s in [&mut clip, &mut pre] {
        s.attach_shm().unwrap();
        s.set_state(&[("w", &wb), ("b", &bb)]).unwrap();
    }
    for (t, factor) in [(1i64, 0.3f64), (2, 4.0), (3, 0.5)] {
        let (gw, gb) = (values(10 + t as u64, W), values(20 + t as u64, B));
        let norm = gw.iter().chain(gb.iter()).map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt();
        let max = factor * norm;
        let coef = max / (norm + 1e-6);
        let c = if coef < 1.0 { coef as f32 } else { 1.0 };
        let arena = clip.arena_mut().unwrap();
        arena.grad_mut("w").unwrap().copy_from_slice(&gw);
        arena.grad_mut("b").unwrap().copy_from_slice(&gb);
        let arena = pre.arena_mut().unwrap();
        for (dst, src) in arena.grad_mut("w").unwrap().iter_mut().zip(&gw) {
            *dst = src * c;
        }
        for (dst, src) in arena.grad_mut("b").unwrap().iter_mut().zip(&gb) {
            *dst = src * c;
        }
        let got = clip.step_with(t, &StepOptions { max_grad_norm: max, ..Default::default() }).unwrap();
        let want = pre.step(t).unwrap();
        assert!((got.grad_norm - norm).abs() <= 1e-12 * norm, "step {t}: {} vs {norm}", got.grad_norm);
        assert_eq!(want.grad_norm, 0.0, "no clip asked, none reported");
        assert_eq!(got.update_norms, want.update_norms, "step {t}");
        for name in ["w", "b"] {
            assert_same_bits(
                clip.arena().unwrap().param(name).unwrap(),
                pre.arena().unwrap().param(name).unwrap(),
                name,
            );
        }
    }
    // torch's rule for a bad max: refused, nothing changed.
    let e = clip.step_with(4, &StepOptions { max_grad_norm: -1.0, ..Default::default() }).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("max_grad_norm"), "{e}");
}

/// DescribeOptions: one row per field of Hyperparameters, and every algorithm's defaults,
/// which the daemon fills in for the fields a builder leaves unset.
#[test]
fn describe_options_serves_the_option_table() {
    let d = Daemon::start(&[], false);
    let table = d.client().describe_options().unwrap();
    let names: Vec<&str> = table.options.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"lr"));
    for name in ["mu", "betas", "oversample", "qr_method", "cqr_warmup_steps"] {
        assert_eq!(names.contains(&name), name != "betas", "{name}");
    }
    let mu = table.options.iter().find(|o| o.name == "mu").unwrap();
    assert_eq!((mu.min, mu.max, mu.max_exclusive), (0.0, 1.0, true));
    assert!(mu.algorithms.contains(&(Algorithm::Muon as i32)));
    assert!(!mu.algorithms.contains(&(Algorithm::Adamw as i32)));
    let qr = table.options.iter().find(|o| o.name == "qr_method").unwrap();
    assert_eq!(qr.enum_values, ["rcqr", "qr", "cqr"]);
    assert!(qr.refused_elsewhere);
    assert_eq!(table.defaults.len(), 7);
    for a in &table.defaults {
        let h = a.hyperparameters.as_ref().unwrap();
        assert_eq!((h.lr, h.mu, h.rank_multiple_of), (Some(0.01), Some(0.95), Some(1)), "{a:?}");
    }
}
