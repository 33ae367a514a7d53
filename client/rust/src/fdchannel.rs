//! The daemon's fd channel: a second Unix socket that takes file descriptors (SCM_RIGHTS),
//! because gRPC cannot carry them. A memfd sent here comes back as a one-time token, which
//! `RegisterRegion` (`MemfdRegion.fd_token`) then presents.
//!
//! The protocol (all integers little-endian; docs/DATA_PLANE.md "The fd channel"):
//!
//! ```text
//! request  (16 bytes)  "DIONDFD1" | u32 version = 1 | u32 kind (1 = memfd, 2 = CUDA VMM fd)
//!                      with exactly one fd attached to these bytes (SCM_RIGHTS)
//! reply    (16 bytes)  "DIONDFD1" | u32 code | u32 length
//!          (length bytes, at most 512) the token when code = 0, else the error message
//! ```

use std::io::Read;
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::error::{Code, Error, Result};

pub const MAGIC: &[u8; 8] = b"DIONDFD1";
pub const VERSION: u32 = 1;
/// The fd is a memfd (`REGION_KIND_MEMFD`).
pub const KIND_MEMFD: u32 = 1;
/// The fd is an exported CUDA VMM allocation (`REGION_KIND_CUDA_VMM_FD`).
pub const KIND_CUDA_VMM_FD: u32 = 2;
/// The longest reply text the channel sends.
pub const MAX_REPLY_BYTES: usize = 512;

/// The 16 request bytes for an fd of `kind`.
pub fn request_bytes(kind: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&kind.to_le_bytes());
    b
}

/// Sends `bytes` with `fd` attached (one SCM_RIGHTS control message).
fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: RawFd) -> std::io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    // u64 elements: the control buffer must be aligned for cmsghdr.
    let mut control = vec![0u64; (space + 7) / 8];
    // SAFETY: msghdr is plain data; every pointer in it points at live locals of this function,
    // and the control buffer holds CMSG_SPACE(sizeof(int)) bytes, enough for one fd.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        loop {
            let n = libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if n >= 0 {
                if n as usize != bytes.len() {
                    // 16 bytes on a stream socket go in one piece; anything else is a broken peer.
                    return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "short write of the request"));
                }
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Sends `fd` (of `kind`) on a connected channel socket and returns the daemon's token; a
/// refusal is an [`Error`] with the channel's code and message.
pub fn send_fd_on(sock: &mut UnixStream, fd: RawFd, kind: u32, shown: &str) -> Result<String> {
    let unavailable = |what: &str, e: std::io::Error| {
        Error::new(Code::Unavailable, format!("the daemon's fd channel at {shown}: {what}: {e}"))
    };
    send_with_fd(sock, &request_bytes(kind), fd).map_err(|e| unavailable("cannot send the fd", e))?;
    let mut head = [0u8; 16];
    sock.read_exact(&mut head).map_err(|e| unavailable("no reply", e))?;
    if &head[..8] != MAGIC {
        return Err(Error::new(
            Code::Internal,
            format!("the fd channel at {shown} answered something that is not its reply"),
        ));
    }
    let code = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    let len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
    if len > MAX_REPLY_BYTES {
        return Err(Error::new(
            Code::Internal,
            format!("the fd channel at {shown} announced a {len}-byte reply (at most {MAX_REPLY_BYTES})"),
        ));
    }
    let mut text = vec![0u8; len];
    sock.read_exact(&mut text).map_err(|e| unavailable("truncated reply", e))?;
    let text = String::from_utf8_lossy(&text).into_owned();
    if code != 0 {
        return Err(Error::new(Code::from_i32(code as i32), text));
    }
    Ok(text)
}

/// Connects to the channel at `path`, sends `fd` and returns its token (one request, then the
/// connection is closed). An absent channel is `Unavailable`.
pub fn send_fd(path: &Path, fd: RawFd, kind: u32, timeout: Duration) -> Result<String> {
    let shown: String = path.display().to_string().chars().take(200).collect();
    let mut sock = UnixStream::connect(path).map_err(|e| {
        Error::new(Code::Unavailable, format!("cannot connect to the daemon's fd channel at {shown}: {e}"))
    })?;
    let _ = sock.set_read_timeout(Some(timeout));
    let _ = sock.set_write_timeout(Some(timeout));
    send_fd_on(&mut sock, fd, kind, &shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Receives 16 bytes and the fds attached to them (what the daemon's side does).
    fn recv_with_fds(sock: &UnixStream) -> (Vec<u8>, Vec<RawFd>) {
        let mut buf = [0u8; 16];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
        let mut control = vec![0u64; 64];
        let mut fds = Vec::new();
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = (control.len() * 8) as _;
            let n = libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            assert_eq!(n, 16);
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c) as *const RawFd;
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(std::ptr::read_unaligned(data.add(i)));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        (buf.to_vec(), fds)
    }

    #[test]
    fn an_fd_crosses_the_socket_and_the_reply_becomes_the_token_or_the_error() {
        use std::io::Write;
        let layout = crate::proto::CreateSessionResponse {
            layout: vec![crate::proto::TensorLayout {
                name: "w".into(),
                size_bytes: 8,
                dtype: 1,
                ..Default::default()
            }],
            param_arena_bytes: 256,
            grad_arena_bytes: 256,
            ..Default::default()
        };
        let mut arena = crate::ShmArena::memfd_for_layout(&layout).unwrap();
        arena.param_mut("w").unwrap().copy_from_slice(&[3.5, -1.0]);
        let (mut client, server) = UnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || {
            let mut server = server;
            let mut answers = Vec::new();
            for reply in [(0u32, "0123456789abcdef0123456789abcdef"), (3, "the fd sent is a pipe, not a memfd")] {
                let (bytes, fds) = recv_with_fds(&server);
                answers.push((bytes, fds.clone()));
                let mut out = MAGIC.to_vec();
                out.extend_from_slice(&reply.0.to_le_bytes());
                out.extend_from_slice(&(reply.1.len() as u32).to_le_bytes());
                out.extend_from_slice(reply.1.as_bytes());
                server.write_all(&out).unwrap();
            }
            answers
        });
        let fd = arena.memfd().unwrap().fd();
        let token = send_fd_on(&mut client, fd, KIND_MEMFD, "test").unwrap();
        assert_eq!(token, "0123456789abcdef0123456789abcdef");
        let e = send_fd_on(&mut client, fd, KIND_MEMFD, "test").unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert_eq!(e.message(), "the fd sent is a pipe, not a memfd");
        let answers = peer.join().unwrap();
        for (bytes, fds) in answers {
            assert_eq!(bytes, request_bytes(KIND_MEMFD));
            assert_eq!(&bytes[..8], b"DIONDFD1");
            assert_eq!(fds.len(), 1, "exactly one fd per request");
            // The received fd is the same memfd: its bytes are the arena's.
            let raw = std::fs::read(format!("/proc/self/fd/{}", fds[0])).unwrap();
            assert_eq!(&raw[..8], &[3.5f32.to_le_bytes(), (-1.0f32).to_le_bytes()].concat()[..]);
            unsafe { libc::close(fds[0]) };
        }
    }

    #[test]
    fn an_absent_channel_is_unavailable_naming_the_path() {
        let e = send_fd(Path::new("/nonexistent/diond.sock.fd"), 0, KIND_MEMFD, Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().contains("/nonexistent/diond.sock.fd"), "{e}");
    }
}
