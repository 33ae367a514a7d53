//! Byte streams to the daemon: the Unix socket, TCP and TLS over TCP, as a hyper connector.
//!
//! Targets are written as the daemon's `--listen` entries are: `unix:/run/diond.sock` (also
//! `unix:///run/diond.sock`), or `host:port` (also `tcp:host:port`, `http://host:port`).
//! TLS is chosen with [`crate::ClientBuilder::tls`] (module [`crate::tls`]), for TCP targets
//! only; the bearer token is a request header that [`crate::ClientBuilder::bearer_token`] puts
//! on every call.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::client::connect::{Connected, Connection};
use hyper::Uri;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::error::{Code, Error, Result};
use crate::tls::{rustls_error_in, tls_closed_error, tls_error, TlsConfig, TlsSetup};

/// How long [`Connector::probe`] waits for the daemon's first HTTP/2 frame.
const PROBE_ANSWER: std::time::Duration = std::time::Duration::from_secs(5);

/// Where the daemon listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

impl Endpoint {
    /// Parses a target (see the module documentation).
    pub fn parse(target: &str) -> Result<Endpoint> {
        let shown: String = target.chars().take(200).collect();
        if let Some(rest) = target.strip_prefix("unix:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(Error::invalid(format!("target '{shown}': empty socket path")));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        let hostport = target
            .strip_prefix("tcp:")
            .or_else(|| target.strip_prefix("http://"))
            .unwrap_or(target)
            .trim_end_matches('/');
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Endpoint::Tcp(hostport.to_string()))
            }
            _ => Err(Error::invalid(format!("target '{shown}': expected unix:PATH or HOST:PORT"))),
        }
    }

    /// The host of a TCP endpoint (an IPv6 literal without its brackets); `None` for Unix.
    pub fn host(&self) -> Option<&str> {
        match self {
            Endpoint::Unix(_) => None,
            Endpoint::Tcp(hp) => {
                let host = hp.rsplit_once(':').map(|(h, _)| h).unwrap_or(hp);
                Some(host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host))
            }
        }
    }

    /// How errors name this endpoint: `unix:PATH` or `HOST:PORT`.
    pub fn shown(&self) -> String {
        match self {
            Endpoint::Unix(p) => format!("unix:{}", p.display()),
            Endpoint::Tcp(hp) => hp.clone(),
        }
        .chars()
        .take(200)
        .collect()
    }

    /// The `:authority` of requests on this endpoint.
    pub fn authority(&self) -> String {
        match self {
            Endpoint::Unix(_) => "localhost".to_string(),
            Endpoint::Tcp(hp) => hp.clone(),
        }
    }

    /// Opens a stream.
    pub async fn connect(&self) -> io::Result<Stream> {
        match self {
            Endpoint::Unix(p) => UnixStream::connect(p)
                .await
                .map(Stream::Unix)
                .map_err(|e| io::Error::new(e.kind(), format!("unix:{}: {e}", p.display()))),
            Endpoint::Tcp(hp) => {
                let s = TcpStream::connect(hp.as_str())
                    .await
                    .map_err(|e| io::Error::new(e.kind(), format!("{hp}: {e}")))?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }
}

/// A connected stream.
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// hyper's connector: every connection goes to the one endpoint, whatever the URI says, and
/// speaks TLS on it when configured.
#[derive(Clone)]
pub struct Connector {
    endpoint: Endpoint,
    tls: Option<Arc<TlsSetup>>,
}

impl Connector {
    /// Plain streams (the Unix socket, TCP).
    pub fn new(endpoint: Endpoint) -> Connector {
        Connector { endpoint, tls: None }
    }

    /// TLS over TCP: loads `tls` now, so that a bad file or name is an `InvalidArgument` error
    /// here; a Unix endpoint is refused (the socket's peer uid is its credential).
    pub fn with_tls(endpoint: Endpoint, tls: &TlsConfig) -> Result<Connector> {
        let host = match endpoint.host() {
            Some(h) => h.to_string(),
            None => {
                return Err(Error::invalid(format!(
                    "TLS is for TCP targets, not {} (the Unix socket needs none)",
                    endpoint.shown()
                )))
            }
        };
        let setup = tls.build(&host)?;
        Ok(Connector { endpoint, tls: Some(Arc::new(setup)) })
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Opens a stream, with the TLS handshake done when configured. An unreachable daemon is
    /// `Unavailable`; a refused handshake is `Unavailable` with [`Error::tls_failure`] set.
    pub async fn open(&self) -> Result<Stream> {
        let shown = self.endpoint.shown();
        let unreachable =
            |e: io::Error| Error::new(Code::Unavailable, format!("cannot reach the daemon at {shown}: {e}"));
        let stream = self.endpoint.connect().await.map_err(&unreachable)?;
        let (setup, tcp) = match (&self.tls, stream) {
            (Some(setup), Stream::Tcp(tcp)) => (setup, tcp),
            (_, s) => return Ok(s),
        };
        match setup.connector.connect(setup.server_name.clone(), tcp).await {
            Ok(tls) => Ok(Stream::Tls(Box::new(tls))),
            Err(e) => match rustls_error_in(&e) {
                Some(r) => Err(tls_error(r, &shown, &setup.shown_name)),
                // Not a TLS verdict: the peer closed or reset the connection mid-handshake.
                None => Err(Error::new(
                    Code::Unavailable,
                    format!("TLS handshake with the daemon at {shown} did not complete: {e}"),
                )),
            },
        }
    }

    /// [`Connector::open`], and on a TLS stream one HTTP/2 exchange (the client preface and an
    /// empty SETTINGS frame, answered by the daemon's SETTINGS): TLS 1.3 delivers the daemon's
    /// verdict on the client certificate after the handshake, so a refused certificate is seen
    /// here, at connect, rather than as a closed connection at the first call. The stream is
    /// then dropped; hyper opens its own.
    pub(crate) async fn probe(&self) -> Result<()> {
        let mut stream = match self.open().await? {
            Stream::Tls(s) => s,
            _ => return Ok(()),
        };
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
        let exchange = async {
            stream.write_all(PREFACE).await?;
            stream.flush().await?;
            let mut first = [0u8; 9];
            stream.read(&mut first).await
        };
        let shown = self.endpoint.shown();
        let setup = self.tls.as_ref().expect("a TLS stream has a TLS setup");
        // The daemon closed the connection before its first frame: with a client certificate
        // presented, that is how gRPC's TLS server refuses it (it closes without an alert).
        let closed = || match setup.has_identity {
            true => tls_closed_error(&shown, &setup.shown_name),
            false => Error::new(
                Code::Unavailable,
                format!("the daemon at {shown} closed the TLS connection without answering"),
            ),
        };
        // A daemon answers at once; one that does not is left to the first call's deadline.
        match tokio::time::timeout(PROBE_ANSWER, exchange).await {
            Err(_) => Ok(()),
            Ok(Ok(n)) if n > 0 => Ok(()),
            Ok(Ok(_)) => Err(closed()),
            Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Err(closed()),
            Ok(Err(e)) => Err(self.tls_error_in(&e).unwrap_or_else(|| {
                Error::new(Code::Unavailable, format!("the TLS connection to the daemon at {shown} failed: {e}"))
            })),
        }
    }

    /// The error for a failure on an established connection: a TLS alert from the daemon (e.g.
    /// its refusal of the client certificate, which TLS 1.3 delivers after the handshake) keeps
    /// its TLS class.
    pub(crate) fn tls_error_in(&self, e: &(dyn std::error::Error + 'static)) -> Option<Error> {
        let setup = self.tls.as_ref()?;
        rustls_error_in(e).map(|r| tls_error(r, &self.endpoint.shown(), &setup.shown_name))
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = Stream;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Stream>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.open().await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_like_the_daemons_listen_entries() {
        assert_eq!(Endpoint::parse("unix:/run/diond.sock").unwrap(), Endpoint::Unix("/run/diond.sock".into()));
        assert_eq!(Endpoint::parse("unix:///tmp/d.sock").unwrap(), Endpoint::Unix("/tmp/d.sock".into()));
        assert_eq!(Endpoint::parse("127.0.0.1:50051").unwrap(), Endpoint::Tcp("127.0.0.1:50051".into()));
        assert_eq!(Endpoint::parse("tcp:[::1]:7").unwrap(), Endpoint::Tcp("[::1]:7".into()));
        assert_eq!(Endpoint::parse("http://localhost:9/").unwrap(), Endpoint::Tcp("localhost:9".into()));
        for bad in ["unix:", "localhost", ":80", "host:notaport", "host:99999"] {
            let e = Endpoint::parse(bad).unwrap_err();
            assert_eq!(e.code(), crate::Code::InvalidArgument, "{bad}");
            assert!(e.message().contains(bad), "{e}");
        }
        assert_eq!(Endpoint::parse("tcp:[::1]:7").unwrap().host(), Some("::1"));
        assert_eq!(Endpoint::parse("localhost:9").unwrap().host(), Some("localhost"));
        assert_eq!(Endpoint::parse("unix:/x").unwrap().host(), None);
        let long = "x".repeat(5000);
        assert!(Endpoint::parse(&long).unwrap_err().message().len() < 300);
    }
}
