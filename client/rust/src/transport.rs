//! Byte streams to the daemon: the Unix socket and TCP, as a hyper connector.
//!
//! Targets are written as the daemon's `--listen` entries are: `unix:/run/diond.sock` (also
//! `unix:///run/diond.sock`), or `host:port` (also `tcp:host:port`, `http://host:port`).
//! TLS and the bearer token are not here yet (the daemon's security work is in progress): a TLS
//! stream is one more [`Stream`] variant wrapping the TCP one, and the token is a request header
//! that [`crate::ClientBuilder::bearer_token`] already puts on every call.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::client::connect::{Connected, Connection};
use hyper::Uri;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::error::{Error, Result};

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

/// A connected stream (a TLS variant joins here later).
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
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
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// hyper's connector: every connection goes to the one endpoint, whatever the URI says.
#[derive(Clone)]
pub struct Connector {
    endpoint: Endpoint,
}

impl Connector {
    pub fn new(endpoint: Endpoint) -> Connector {
        Connector { endpoint }
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = Stream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Stream>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let endpoint = self.endpoint.clone();
        Box::pin(async move { endpoint.connect().await })
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
        let long = "x".repeat(5000);
        assert!(Endpoint::parse(&long).unwrap_err().message().len() < 300);
    }
}
