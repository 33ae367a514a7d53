//! Failures: an absent or vanished daemon, a wrong session, bad options, out-of-order steps and
//! deadlines, each as a typed error with the daemon's code and message, and nothing changed.

mod common;

use std::time::Duration;

use common::{assert_same_bits, temp_dir, Daemon, Proxy};
use diond::{proto, Algorithm, Client, Code, Group, RetryPolicy, SessionSpec};

fn spec() -> SessionSpec {
    SessionSpec::new().group(Group::new("g", Algorithm::Muon).lr(0.02)).param("w", &[16, 8], "g")
}

#[test]
fn an_absent_daemon_is_unavailable_at_connect() {
    let dir = temp_dir("absent");
    let sock = dir.join("nobody.sock");
    let e = Client::connect(&format!("unix:{}", sock.display())).err().expect("no daemon there");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("nobody.sock"), "{e}");
    // A TCP port nobody listens on (bound then closed, so it is free).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let e = Client::connect(&format!("127.0.0.1:{port}")).err().expect("no daemon on the port");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    // A malformed target is the caller's error, not the network's.
    assert_eq!(Client::connect("nonsense").err().unwrap().code(), Code::InvalidArgument);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_daemon_that_goes_away_is_unavailable_after_the_retries() {
    let mut d = Daemon::start(&[], false);
    let client = d.client();
    let mut s = client.create_session(&spec()).unwrap();
    s.attach_shm().unwrap();
    s.step(1).unwrap();
    drop(std::mem::replace(&mut d, Daemon::start(&[], false))); // kills the first daemon
    assert!(d.alive());
    s.set_retry_policy(RetryPolicy { attempts: 3, backoff: Duration::from_millis(20) });
    let e = s.step(2).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    let e = client.list_sessions().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    // Dropping the session (its CloseSession fails) must neither panic nor leak its segments.
    let (p, g) = s.arena().unwrap().segment_names().unwrap();
    let mine = [p.to_string(), g.to_string()];
    drop(s);
    assert!(mine.iter().all(|n| !common::leftover_segments().contains(n)));
}

#[test]
fn a_wrong_session_is_not_found_for_every_rpc() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let bad = "no-such-session".to_string();
    let rpc = client.rpc();
    let errors = vec![
        ("Step", rpc.step(proto::StepRequest { session_id: bad.clone(), step_index: 1, ..Default::default() }).err()),
        (
            "PushGradients",
            rpc.push_gradients(vec![proto::TensorChunk {
                session_id: bad.clone(),
                name: "w".into(),
                data: vec![0; 4],
                ..Default::default()
            }])
            .err(),
        ),
        (
            "PullParameters",
            rpc.pull_parameters(proto::PullParametersRequest { session_id: bad.clone(), ..Default::default() }, |_| {
                Ok(())
            })
            .err(),
        ),
        (
            "GetState",
            rpc.get_state(proto::GetStateRequest { session_id: bad.clone(), include_parameters: true }, |_| Ok(()))
                .err(),
        ),
        (
            "SetState",
            rpc.set_state(vec![proto::TensorChunk {
                session_id: bad.clone(),
                name: "w".into(),
                data: vec![0; 4],
                ..Default::default()
            }])
            .err(),
        ),
        (
            "SetHyperparameters",
            rpc.set_hyperparameters(proto::SetHyperparametersRequest {
                session_id: bad.clone(),
                group: "g".into(),
                hyperparameters: None,
            })
            .err(),
        ),
        (
            "SaveCheckpoint",
            rpc.save_checkpoint(proto::SaveCheckpointRequest {
                session_id: bad.clone(),
                directory: d.dir.join("ckpt").display().to_string(),
            })
            .err(),
        ),
        ("CloseSession", rpc.close_session(proto::CloseSessionRequest { session_id: bad.clone() }).err()),
        (
            "UnregisterRegion",
            rpc.unregister_region(proto::UnregisterRegionRequest { session_id: bad.clone(), region_id: "r".into() })
                .err(),
        ),
    ];
    for (name, e) in errors {
        let e = e.unwrap_or_else(|| panic!("{name} on an unknown session succeeded"));
        assert_eq!(e.code(), Code::NotFound, "{name}: {e}");
        assert!(e.message().contains(&bad), "{name}: {e}");
    }
    // Non-ASCII in the echoed id comes back intact (grpc-message is percent-encoded on the wire).
    let odd = "sessión-ünknown";
    let e = rpc.step(proto::StepRequest { session_id: odd.into(), step_index: 1, ..Default::default() }).unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains(odd), "{e}");
}

#[test]
fn bad_options_are_invalid_arguments_naming_the_field_and_create_nothing() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let cases: Vec<(&str, SessionSpec)> = vec![
        ("algorithm", SessionSpec::new().group(Group::new("g", Algorithm::Unspecified)).param("w", &[4, 4], "g")),
        ("lr", SessionSpec::new().group(Group::new("g", Algorithm::Muon).lr(-1.0)).param("w", &[4, 4], "g")),
        (
            "fraction",
            SessionSpec::new().group(Group::new("g", Algorithm::Dion2).fraction(2.0)).param("w", &[4, 4], "g"),
        ),
        ("group", SessionSpec::new().group(Group::new("g", Algorithm::Muon)).param("w", &[4, 4], "nope")),
        (
            "split_sizes",
            SessionSpec::new().group(Group::new("g", Algorithm::Muon).split_sizes(&[3, 3])).param("w", &[4, 4], "g"),
        ),
        ("shape", SessionSpec::new().group(Group::new("g", Algorithm::Muon)).param("w", &[4, -4], "g")),
        (
            "w",
            SessionSpec::new().group(Group::new("g", Algorithm::Muon)).param("w", &[4, 4], "g").param(
                "w",
                &[4, 4],
                "g",
            ),
        ),
    ];
    for (field, s) in cases {
        let e = client.create_session(&s).err().unwrap_or_else(|| panic!("{field}: accepted"));
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e}");
        assert!(e.message().contains(field), "{field}: {e}");
    }
    assert!(client.list_sessions().unwrap().is_empty(), "a refused CreateSession left a session");

    // A bad SetHyperparameters changes nothing either.
    let mut s = client.create_session(&spec()).unwrap();
    let e = s.set_hyperparameters("g", &diond::Hyperparameters::new().lr(f64::NAN)).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e = s.set_hyperparameters("other", &diond::Hyperparameters::new().lr(0.1)).unwrap_err();
    assert!(e.message().contains("other"), "{e}");
    // A SetState of the wrong size is refused whole.
    let e = s.set_state(&[("w", &[0u8; 12])]).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    s.close().unwrap();
}

#[test]
fn out_of_order_steps_and_deadlines() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let mut s = client.create_session(&spec()).unwrap();
    s.attach_shm().unwrap();
    let e = s.step(0).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let e = s.step(2).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("expected 1"), "{e}");
    s.step(1).unwrap();

    // A deadline too short for any answer: DEADLINE_EXCEEDED here, and the session is intact.
    let hurried = client.with_timeout(Some(Duration::from_micros(1)));
    let e = hurried.list_sessions().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    let e = hurried.rpc().step(proto::StepRequest { session_id: s.id().into(), step_index: 2, ..Default::default() });
    // The step may or may not have reached the daemon; either way the retry is exact.
    assert_eq!(e.unwrap_err().code(), Code::DeadlineExceeded);
    let r = s.step(2).unwrap();
    assert_eq!(r.step_index, 2);
    // A bad metadata key is refused before anything is sent.
    let e = Client::builder(&d.target()).metadata("bad key", "x").connect().err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[test]
fn a_lost_step_answer_is_retried_and_the_step_applies_once() {
    let d = Daemon::start(&[], false);
    let proxy = Proxy::start(&d.socket, &d.dir);
    let via_proxy = Client::builder(&proxy.target()).timeout(Duration::from_secs(60)).connect().unwrap();
    let direct = d.client();
    let w0: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<Vec<f32>> = (0..2).map(|t| (0..128).map(|i| ((i + 7 * t) as f32 * 0.11).cos()).collect()).collect();
    let w0b = diond::tensor::f32_bytes(&w0);

    // The twin steps over a direct connection; `s` through the proxy, which loses the answer
    // of step 2 after the daemon has applied it.
    let mut twin = direct.create_session(&spec()).unwrap();
    let mut s = via_proxy.create_session(&spec()).unwrap();
    for sess in [&mut twin, &mut s] {
        sess.attach_shm().unwrap();
        sess.set_state(&[("w", &w0b)]).unwrap();
        sess.arena_mut().unwrap().grad_mut("w").unwrap().copy_from_slice(&g[0]);
        sess.step(1).unwrap();
        sess.arena_mut().unwrap().grad_mut("w").unwrap().copy_from_slice(&g[1]);
    }
    twin.step(2).unwrap();
    let before = proxy.connections();
    proxy.lose_next_answer();
    s.set_retry_policy(RetryPolicy { attempts: 4, backoff: Duration::from_millis(10) });
    let r = s.step(2).expect("the retry recovers");
    assert_eq!(r.step_index, 2);
    assert!(proxy.connections() > before, "the client did not reconnect");
    // Applied exactly once: the same bytes as the twin that stepped once.
    assert_same_bits(
        s.arena().unwrap().param("w").unwrap(),
        twin.arena().unwrap().param("w").unwrap(),
        "after the retried step",
    );
    assert!(s.get_state(true).unwrap() == twin.get_state(true).unwrap(), "states differ");
}
