//! The memfd arena against the real daemon (docs/DATA_PLANE.md): a session stepped over a
//! sealed memfd gives the same bytes as one stepped over POSIX shm, the fd channel's tokens are
//! one-time, and what the daemon refuses (an fd that is no memfd, an unsealed memfd) comes back
//! as its code and message. A daemon without the data plane (no fd channel in its
//! CreateSession answer) must refuse attach_memfd before anything is created, and attach() must
//! then fall back to POSIX shm.

mod common;

use std::time::Duration;

use common::{assert_same_bits, Daemon};
use diond::{fdchannel, proto, Algorithm, Client, Code, Group, SessionSpec};

fn spec(name: &str) -> SessionSpec {
    SessionSpec::new()
        .client_name(name)
        .group(Group::new("m", Algorithm::Muon).lr(0.02).weight_decay(0.01))
        .group(Group::new("a", Algorithm::Adamw).lr(1e-3))
        .param("w", &[16, 12], "m")
        .param("b", &[12], "a")
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn offers_memfd(layout: &proto::CreateSessionResponse) -> bool {
    layout.region_kinds.contains(&(proto::RegionKind::Memfd as i32)) && !layout.fd_channel_socket.is_empty()
}

/// Three steps with the same weights and gradients written into the session's arena.
fn train(s: &mut diond::Session) -> Vec<(String, Vec<f32>)> {
    {
        let a = s.arena_mut().unwrap();
        a.param_mut("w").unwrap().copy_from_slice(&values(1, 16 * 12));
        a.param_mut("b").unwrap().copy_from_slice(&values(2, 12));
    }
    for step in 1..=3 {
        let a = s.arena_mut().unwrap();
        a.grad_mut("w").unwrap().copy_from_slice(&values(10 + step, 16 * 12));
        a.grad_mut("b").unwrap().copy_from_slice(&values(20 + step, 12));
        s.step(step as i64).unwrap();
    }
    let a = s.arena().unwrap();
    ["w", "b"].iter().map(|n| (n.to_string(), a.param(n).unwrap().to_vec())).collect()
}

fn register_with_token(client: &Client, session: &str, token: &str, size: i64) -> diond::Result<String> {
    client
        .rpc()
        .register_region(proto::RegisterRegionRequest {
            session_id: session.to_string(),
            role: proto::RegionRole::Parameters as i32,
            kind: proto::RegionKind::Memfd as i32,
            region: Some(proto::register_region_request::Region::Memfd(proto::MemfdRegion {
                offset_bytes: 0,
                size_bytes: size,
                fd_token: token.to_string(),
            })),
            ..Default::default()
        })
        .map(|r| r.region_id)
}

#[test]
fn a_memfd_session_steps_like_a_shm_session_and_the_daemon_checks_what_it_is_sent() {
    let d = Daemon::start(&[], false);
    let client = d.client();
    let mut m = client.create_session(&spec("rs-memfd")).unwrap();

    if !offers_memfd(m.layout()) {
        // A daemon without the data plane: refused up front, and attach() takes POSIX shm.
        let e = m.attach_memfd().unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("attach_shm"), "{e}");
        assert!(m.arena().is_none() && m.region_ids().is_empty());
        assert_eq!(m.attach().unwrap().kind(), proto::RegionKind::SystemShm);
        return;
    }

    // attach() picks the memfd on the Unix socket.
    assert_eq!(m.attach().unwrap().kind(), proto::RegionKind::Memfd);
    assert_eq!(m.region_ids().len(), 2);
    let via_memfd = train(&mut m);
    let mut s = client.create_session(&spec("rs-shm")).unwrap();
    s.attach_shm().unwrap();
    let via_shm = train(&mut s);
    for ((name, a), (_, b)) in via_memfd.iter().zip(&via_shm) {
        assert_same_bits(a, b, &format!("{name}: memfd vs shm"));
    }
    // The daemon wrote into the memfd: its own view of the parameters is the arena's.
    let pulled = m.pull_parameters(&[]).unwrap();
    for (name, v) in &via_memfd {
        assert_same_bits(&pulled[name].to_f32().unwrap(), v, &format!("{name}: pulled vs memfd arena"));
    }
    // Detach and attach again: new tokens, the same memory kind.
    m.detach_shm().unwrap();
    assert_eq!(m.attach_memfd().unwrap().kind(), proto::RegionKind::Memfd);

    let channel = std::path::PathBuf::from(&m.layout().fd_channel_socket);
    let t = Duration::from_secs(10);
    let mut fresh = client.create_session(&spec("rs-refusals")).unwrap();
    let size = fresh.layout().param_arena_bytes;

    // A pipe is no memfd: the channel takes it, RegisterRegion refuses it; the token is spent.
    let mut pipe = [0; 2];
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let token = fdchannel::send_fd(&channel, pipe[0], fdchannel::KIND_MEMFD, t).unwrap();
    assert_eq!(token.len(), 32, "{token}");
    let e = register_with_token(&client, fresh.id(), &token, size).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("memfd"), "{e}");
    let e = register_with_token(&client, fresh.id(), &token, size).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "a token is one-time: {e}");
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }

    // A memfd without the seals is refused, naming them.
    let fd = unsafe {
        let name = std::ffi::CString::new("rs-unsealed").unwrap();
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, size as libc::off_t), 0);
        fd
    };
    let token = fdchannel::send_fd(&channel, fd, fdchannel::KIND_MEMFD, t).unwrap();
    let e = register_with_token(&client, fresh.id(), &token, size).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("F_SEAL"), "{e}");
    unsafe { libc::close(fd) };

    // A token the daemon never issued.
    let e = register_with_token(&client, fresh.id(), &"0".repeat(32), size).unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");

    // None of that bound anything: the session still takes a proper memfd arena.
    assert_eq!(fresh.attach_memfd().unwrap().kind(), proto::RegionKind::Memfd);
    fresh.step(1).unwrap_or_else(|e| panic!("step over the memfd after the refusals: {e}"));
}
