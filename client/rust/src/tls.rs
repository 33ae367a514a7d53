//! TLS on TCP targets: verification of the daemon against a CA, an optional client certificate
//! (mutual TLS), with rustls 0.20 through tokio-rustls 0.23 (Debian 12's versions).
//!
//! ```no_run
//! use diond::{Client, TlsConfig};
//! # fn main() -> diond::Result<()> {
//! let client = Client::builder("diond.example.org:50051")
//!     .tls(TlsConfig::new().ca_file("/etc/diond/ca.pem").identity("/etc/diond/me.pem", "/etc/diond/me.key"))
//!     .connect()?;
//! # Ok(()) }
//! ```
//!
//! - The daemon's certificate must chain to the CA given ([`TlsConfig::ca_file`] /
//!   [`TlsConfig::ca_pem`]); without one, the system bundle
//!   (`/etc/ssl/certs/ca-certificates.crt`) is used.
//! - It must be valid for the target's host name, or for [`TlsConfig::server_name`]. rustls 0.20
//!   verifies DNS names only: for a target written as an IP address (`127.0.0.1:50051`) set
//!   `server_name` to a DNS name of the certificate (often `localhost`); connecting without one
//!   is an `InvalidArgument` error before anything is sent.
//! - [`TlsConfig::identity`] presents a client certificate: on a daemon with `--tls_client_ca` it
//!   is a credential of its own (`x509:<subject>`), so no bearer token is needed.
//! - ALPN offers `h2`, as gRPC requires.
//!
//! Failures are [`Error`]s: configuration mistakes (unreadable or empty PEM files, a key that is
//! not one) are `InvalidArgument` at `connect`; a refused handshake is `Unavailable` with
//! [`Error::tls_failure`] telling why ([`TlsFailure`]). Those are not transient: retrying the
//! same call does not help.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::{self, AlertDescription, Certificate, ClientConfig, PrivateKey, RootCertStore, ServerName};

use crate::error::{Code, Error, Result};

/// The CA bundle used when [`TlsConfig`] names none (Debian's `ca-certificates`).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Why a TLS connection failed (see [`Error::tls_failure`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TlsFailure {
    /// The daemon's certificate does not chain to a trusted CA (or is expired, or malformed).
    UntrustedServer,
    /// The daemon's certificate is not valid for the name checked.
    NameMismatch,
    /// The daemon refused this client's certificate, or required one that was not sent.
    ClientCertificateRejected,
    /// Any other handshake failure (e.g. the port does not speak TLS).
    Handshake,
}

impl TlsFailure {
    pub fn describe(self) -> &'static str {
        match self {
            TlsFailure::UntrustedServer => "the daemon's certificate is not trusted (is it signed by the CA given?)",
            TlsFailure::NameMismatch => "the daemon's certificate is not valid for the server name",
            TlsFailure::ClientCertificateRejected => "the daemon refused the client certificate (or wanted one)",
            TlsFailure::Handshake => "the TLS handshake failed",
        }
    }
}

#[derive(Clone)]
enum Pem {
    File(PathBuf),
    Bytes(Vec<u8>),
}

impl Pem {
    fn shown(&self) -> String {
        match self {
            Pem::File(p) => format!("'{}'", p.display().to_string().chars().take(200).collect::<String>()),
            Pem::Bytes(_) => "(PEM given in memory)".to_string(),
        }
    }
    fn read(&self, what: &str) -> Result<Vec<u8>> {
        match self {
            Pem::Bytes(b) => Ok(b.clone()),
            Pem::File(p) => std::fs::read(p)
                .map_err(|e| Error::invalid(format!("cannot read the TLS {what} file {}: {e}", self.shown()))),
        }
    }
}

impl fmt::Debug for Pem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never prints key material.
        f.write_str(&self.shown())
    }
}

/// How to speak TLS to the daemon: the CA, an optional client identity, the server name.
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    ca: Option<Pem>,
    identity: Option<(Pem, Pem)>,
    server_name: Option<String>,
}

impl TlsConfig {
    /// TLS with the system CA bundle, no client certificate, the target's host as server name.
    pub fn new() -> TlsConfig {
        TlsConfig::default()
    }
    /// The PEM CA bundle that the daemon's certificate must chain to (the daemon's `--tls_cert`
    /// is signed by it).
    pub fn ca_file(mut self, path: impl AsRef<Path>) -> Self {
        self.ca = Some(Pem::File(path.as_ref().to_path_buf()));
        self
    }
    /// The CA bundle as PEM bytes.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(Pem::Bytes(pem.into()));
        self
    }
    /// A client certificate chain and its private key (PEM files; PKCS#8, RSA or SEC1 EC key),
    /// for mutual TLS with a daemon that has `--tls_client_ca`.
    pub fn identity(mut self, cert_file: impl AsRef<Path>, key_file: impl AsRef<Path>) -> Self {
        self.identity = Some((Pem::File(cert_file.as_ref().to_path_buf()), Pem::File(key_file.as_ref().to_path_buf())));
        self
    }
    /// The client identity as PEM bytes.
    pub fn identity_pem(mut self, cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.identity = Some((Pem::Bytes(cert_pem.into()), Pem::Bytes(key_pem.into())));
        self
    }
    /// The DNS name the daemon's certificate is checked against (and sent as SNI) instead of the
    /// target's host; needed when the target is an IP address.
    pub fn server_name(mut self, name: &str) -> Self {
        self.server_name = Some(name.to_string());
        self
    }

    /// Loads the files and makes the connector for `host` (the target's host, brackets of an IPv6
    /// literal removed). Every mistake is `InvalidArgument` naming the file or name.
    pub(crate) fn build(&self, host: &str) -> Result<TlsSetup> {
        let ca = self.ca.clone().unwrap_or_else(|| Pem::File(PathBuf::from(SYSTEM_CA_BUNDLE)));
        let ca_bytes = ca.read("CA")?;
        let ca_certs = read_certs(&ca_bytes, &ca, "CA")?;
        let mut roots = RootCertStore::empty();
        for (i, der) in ca_certs.into_iter().enumerate() {
            roots.add(&Certificate(der)).map_err(|e| {
                Error::invalid(format!("TLS CA {}: certificate {} is not usable as a CA: {e}", ca.shown(), i + 1))
            })?;
        }
        let builder = ClientConfig::builder().with_safe_defaults().with_root_certificates(roots);
        let mut config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = read_certs(&cert.read("client certificate")?, cert, "client certificate")?;
                let key_der = read_key(&key.read("client key")?, key)?;
                builder.with_single_cert(chain.into_iter().map(Certificate).collect(), key_der).map_err(|e| {
                    Error::invalid(format!(
                        "TLS client identity {} / {}: the key is not usable: {e}",
                        cert.shown(),
                        key.shown()
                    ))
                })?
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let name = self.server_name.clone().unwrap_or_else(|| host.to_string());
        let shown: String = name.chars().take(200).collect();
        let server_name = match ServerName::try_from(name.as_str()) {
            Ok(ServerName::IpAddress(_)) => {
                return Err(Error::invalid(format!(
                    "TLS to the IP address {shown}: this client (rustls 0.20) verifies DNS names only; \
                     set TlsConfig::server_name to a DNS name of the daemon's certificate (e.g. localhost)"
                )))
            }
            Ok(n) => n,
            Err(_) => return Err(Error::invalid(format!("TLS server name '{shown}' is not a valid DNS name"))),
        };
        Ok(TlsSetup {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            has_identity: self.identity.is_some(),
            server_name,
            shown_name: shown,
        })
    }
}

fn read_certs(bytes: &[u8], from: &Pem, what: &str) -> Result<Vec<Vec<u8>>> {
    let certs = rustls_pemfile::certs(&mut &bytes[..])
        .map_err(|e| Error::invalid(format!("TLS {what} {}: not PEM: {e}", from.shown())))?;
    if certs.is_empty() {
        return Err(Error::invalid(format!("TLS {what} {} holds no PEM certificate", from.shown())));
    }
    Ok(certs)
}

fn read_key(bytes: &[u8], from: &Pem) -> Result<PrivateKey> {
    let items = rustls_pemfile::read_all(&mut &bytes[..])
        .map_err(|e| Error::invalid(format!("TLS client key {}: not PEM: {e}", from.shown())))?;
    for item in items {
        match item {
            rustls_pemfile::Item::PKCS8Key(k) | rustls_pemfile::Item::RSAKey(k) | rustls_pemfile::Item::ECKey(k) => {
                return Ok(PrivateKey(k))
            }
            _ => {}
        }
    }
    Err(Error::invalid(format!("TLS client key {} holds no PEM private key (PKCS#8, RSA or EC)", from.shown())))
}

/// A loaded [`TlsConfig`]: what the transport needs for each connection.
pub(crate) struct TlsSetup {
    pub connector: tokio_rustls::TlsConnector,
    pub has_identity: bool,
    pub server_name: ServerName,
    pub shown_name: String,
}

/// The failure class of a rustls error.
pub(crate) fn classify(e: &rustls::Error) -> TlsFailure {
    use rustls::Error as E;
    match e {
        E::InvalidCertificateData(s) if s.contains("CertNotValidForName") => TlsFailure::NameMismatch,
        E::InvalidCertificateData(_)
        | E::InvalidCertificateEncoding
        | E::InvalidCertificateSignature
        | E::InvalidCertificateSignatureType
        | E::InvalidSct(_) => TlsFailure::UntrustedServer,
        E::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::CertificateRequired
            | AlertDescription::HandshakeFailure,
        ) => TlsFailure::ClientCertificateRejected,
        _ => TlsFailure::Handshake,
    }
}

/// The crate error for a TLS failure on the connection to `to` (`host:port`, as 'name').
pub(crate) fn tls_error(e: &rustls::Error, to: &str, name: &str) -> Error {
    let failure = classify(e);
    let hint = match e {
        rustls::Error::CorruptMessage | rustls::Error::CorruptMessagePayload(_) => {
            " (does the daemon's TCP listener speak TLS, i.e. was it started with --tls_cert?)"
        }
        _ => "",
    };
    Error::new(
        Code::Unavailable,
        format!("TLS with the daemon at {to} (as '{name}') failed: {}: {e}{hint}", failure.describe()),
    )
    .with_tls_failure(failure)
}

/// The daemon closed the connection after the handshake and before its first HTTP/2 frame while
/// a client certificate was presented: gRPC's TLS server refuses a certificate that way (TLS 1.3
/// finishes the client's side of the handshake before the server has checked it).
pub(crate) fn tls_closed_error(to: &str, name: &str) -> Error {
    let failure = TlsFailure::ClientCertificateRejected;
    Error::new(
        Code::Unavailable,
        format!(
            "TLS with the daemon at {to} (as '{name}') failed: {}: the daemon closed the connection right after \
             the handshake (is the client certificate signed by the daemon's --tls_client_ca?)",
            failure.describe()
        ),
    )
    .with_tls_failure(failure)
}

/// The rustls error inside an I/O error, if that is what it is.
pub(crate) fn rustls_error_in<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(r) = e.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).and_then(|inner| {
        let inner: &(dyn std::error::Error + 'static) = inner;
        inner.downcast_ref::<rustls::Error>()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_mistakes_are_invalid_arguments_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("diond-rs-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("no-such-ca.pem");
        let e = TlsConfig::new().ca_file(&missing).build("localhost").err().unwrap();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("no-such-ca.pem"), "{e}");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = TlsConfig::new().ca_file(&empty).build("localhost").err().unwrap();
        assert!(e.message().contains("holds no PEM certificate") && e.message().contains("empty.pem"), "{e}");
        let e = TlsConfig::new()
            .ca_pem("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
            .build("localhost")
            .err()
            .unwrap();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("not usable as a CA"), "{e}");
        assert!(e.tls_failure().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rustls_errors_map_to_failure_classes() {
        use rustls::Error as E;
        assert_eq!(
            classify(&E::InvalidCertificateData("invalid peer certificate: UnknownIssuer".into())),
            TlsFailure::UntrustedServer
        );
        assert_eq!(
            classify(&E::InvalidCertificateData("invalid peer certificate: CertNotValidForName".into())),
            TlsFailure::NameMismatch
        );
        assert_eq!(classify(&E::AlertReceived(AlertDescription::UnknownCA)), TlsFailure::ClientCertificateRejected);
        assert_eq!(classify(&E::CorruptMessage), TlsFailure::Handshake);
        let e = tls_error(&E::AlertReceived(AlertDescription::CertificateRequired), "h:1", "h");
        assert_eq!(e.code(), Code::Unavailable);
        assert_eq!(e.tls_failure(), Some(TlsFailure::ClientCertificateRejected));
        assert!(!e.is_transient(), "{e}");
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, E::CorruptMessage);
        assert_eq!(rustls_error_in(&io), Some(&E::CorruptMessage));
    }
}
