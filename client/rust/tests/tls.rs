//! TLS against the real daemon (docs/OPERATIONS.md "Security"), with certificates made here by
//! `openssl` for each run (never committed): the daemon verified against its CA, refused under
//! another CA or another name, mutual TLS (a client certificate is a credential; without one the
//! call is refused), TLS with the bearer token, and every failure a typed error.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{temp_dir, Daemon};
use diond::{proto, Algorithm, Client, Code, Group, SessionSpec, TlsConfig, TlsFailure};

const TOKEN: &str = "rust-tls-token-0123456789";

/// A throw-away PKI in a temporary folder: CAs and certificates signed by them (EC P-256).
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        Pki { dir: temp_dir("pki") }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Runs `openssl` with `args` (split at blanks; no argument here has one) in the folder.
    fn openssl(&self, args: &str) {
        let args: Vec<&str> = args.split_whitespace().collect();
        let out = Command::new("openssl")
            .args(&args)
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run openssl (Debian: openssl): {e}"));
        assert!(out.status.success(), "openssl {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    /// A self-signed CA: `<name>.pem`, `<name>.key`.
    fn ca(&self, name: &str) {
        self.openssl(&format!(
            "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout {name}.key \
             -out {name}.pem -days 1 -subj /CN={name}"
        ));
    }

    /// A certificate `<name>.pem` / `<name>.key` with subject CN=`cn`, signed by CA `ca`, with
    /// the extensions in `ext` (openssl x509 -extfile syntax).
    fn cert(&self, name: &str, cn: &str, ca: &str, ext: &str) {
        std::fs::write(self.path(&format!("{name}.ext")), ext).unwrap();
        self.openssl(&format!(
            "req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout {name}.key -out {name}.csr \
             -subj /CN={cn}"
        ));
        self.openssl(&format!(
            "x509 -req -in {name}.csr -CA {ca}.pem -CAkey {ca}.key -CAserial {ca}.srl -CAcreateserial -days 1 \
             -extfile {name}.ext -out {name}.pem"
        ));
    }

    fn server_cert(&self, name: &str, ca: &str) {
        self.cert(
            name,
            "diond-test-server",
            ca,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
        );
    }

    fn client_cert(&self, name: &str, cn: &str, ca: &str) {
        self.cert(name, cn, ca, "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n");
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn token_flag(dir: &Path) -> String {
    let tokens = dir.join("tokens.txt");
    std::fs::write(&tokens, format!("{TOKEN} rust-tls\n")).unwrap();
    format!("--auth_token_file={}", tokens.display())
}

fn spec() -> SessionSpec {
    SessionSpec::new().group(Group::new("g", Algorithm::Adamw).lr(0.01)).param("w", &[4, 3], "g")
}

fn flag(name: &str, p: &Path) -> String {
    format!("--{name}={}", p.display())
}

/// The target of the daemon's TCP listener (loopback, by IP).
fn tcp_target(d: &Daemon) -> String {
    format!("127.0.0.1:{}", d.tcp_port.expect("the ready file names the TCP port"))
}

fn builder(target: &str) -> diond::ClientBuilder {
    Client::builder(target).timeout(Duration::from_secs(60))
}

#[test]
fn tls_verifies_the_daemon_and_carries_the_token() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("other-ca");
    pki.server_cert("server", "ca");
    let d = Daemon::start(
        &[&flag("tls_cert", &pki.path("server.pem")), &flag("tls_key", &pki.path("server.key")), &token_flag(&pki.dir)],
        true,
    );
    let target = tcp_target(&d);
    let tls = || TlsConfig::new().ca_file(pki.path("ca.pem")).server_name("localhost");

    // Verified and authenticated by the token: every kind of call works over TLS.
    let client = builder(&target).tls(tls()).bearer_token(TOKEN).connect().expect("TLS with the daemon's CA");
    assert!(client.list_sessions().unwrap().is_empty());
    let mut s = client.create_session(&spec()).unwrap();
    let w0: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    assert_eq!(s.set_state(&[("w", &diond::tensor::f32_bytes(&w0))]).unwrap(), 1);
    s.push_gradients(&[("w", &[0.5f32; 12])]).unwrap();
    s.step(1).unwrap();
    let after = s.pull_parameters(&[]).unwrap();
    let w1 = after["w"].to_f32().unwrap();
    // AdamW's first step moves every weight against its gradient's sign by about lr.
    for (a, b) in w1.iter().zip(&w0) {
        assert!((b - a - 0.01).abs() < 1e-3, "{b} -> {a}");
    }
    let sessions = client.list_sessions().unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].owner, "rust-tls");
    s.close().unwrap();

    // The target's own host name is the server name when it is a DNS name.
    let by_name = format!("localhost:{}", d.tcp_port.unwrap());
    let c = builder(&by_name).tls(TlsConfig::new().ca_pem(std::fs::read(pki.path("ca.pem")).unwrap()));
    assert!(c.bearer_token(TOKEN).connect().unwrap().list_sessions().unwrap().is_empty());

    // A token file instead of the token.
    let tf = pki.path("token");
    std::fs::write(&tf, format!("{TOKEN}\n")).unwrap();
    let c = builder(&target).tls(tls()).bearer_token_file(&tf).connect().unwrap();
    assert!(c.list_sessions().unwrap().is_empty());

    // TLS is no credential: without the token (or with a wrong one) the daemon refuses the call.
    let anonymous = builder(&target).tls(tls()).connect().expect("the handshake needs no token");
    let e = anonymous.list_sessions().unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    assert_eq!(e.tls_failure(), None);
    let e = builder(&target).tls(tls()).bearer_token("wrong-token-0123456789").connect().unwrap();
    assert_eq!(e.list_sessions().unwrap_err().code(), Code::Unauthenticated);

    // Another CA: the handshake is refused at connect, typed, not worth retrying.
    let e = builder(&target)
        .tls(TlsConfig::new().ca_file(pki.path("other-ca.pem")).server_name("localhost"))
        .bearer_token(TOKEN)
        .connect()
        .err()
        .expect("a daemon certificate of another CA must be refused");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(e.tls_failure(), Some(TlsFailure::UntrustedServer), "{e}");
    assert!(!e.is_transient());
    assert!(e.message().contains("not trusted") && e.message().contains(&target), "{e}");

    // A name the certificate does not carry.
    let e = builder(&target)
        .tls(TlsConfig::new().ca_file(pki.path("ca.pem")).server_name("elsewhere.example"))
        .connect()
        .err()
        .expect("a certificate for another name must be refused");
    assert_eq!(e.tls_failure(), Some(TlsFailure::NameMismatch), "{e}");
    assert!(e.message().contains("elsewhere.example"), "{e}");

    // An IP target without a server name: rustls 0.20 cannot check IP names; said before connecting.
    let e = builder(&target).tls(TlsConfig::new().ca_file(pki.path("ca.pem"))).connect().err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("server_name") && e.message().contains("127.0.0.1"), "{e}");

    // Configuration mistakes name the file; TLS on the Unix socket is refused.
    let e = builder(&target).tls(tls().ca_file(pki.path("absent.pem"))).connect().err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("absent.pem"), "{e}");
    let e = builder(&d.target()).tls(tls()).connect().err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("TCP"), "{e}");
    let e = builder(&target).bearer_token_file(pki.path("no-token")).connect().err().unwrap();
    assert!(e.code() == Code::InvalidArgument && e.message().contains("no-token"), "{e}");

    // Plaintext to the TLS listener: no gRPC answer, Unavailable.
    let plain = builder(&target).timeout(Duration::from_secs(10)).bearer_token(TOKEN).connect().unwrap();
    let e = plain.list_sessions().unwrap_err();
    assert!(matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded), "{e}");

    // The Unix socket still works without TLS.
    assert!(d.client().list_sessions().unwrap().is_empty());
}

#[test]
fn mutual_tls_makes_the_client_certificate_a_credential() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("clients-ca");
    pki.ca("rogue-ca");
    pki.server_cert("server", "ca");
    pki.client_cert("trainer", "rust-trainer", "clients-ca");
    pki.client_cert("rogue", "rust-rogue", "rogue-ca");
    let d = Daemon::start(
        &[
            &flag("tls_cert", &pki.path("server.pem")),
            &flag("tls_key", &pki.path("server.key")),
            &flag("tls_client_ca", &pki.path("clients-ca.pem")),
            &token_flag(&pki.dir),
        ],
        true,
    );
    let target = tcp_target(&d);
    let tls = || TlsConfig::new().ca_file(pki.path("ca.pem")).server_name("localhost");

    // The client certificate alone authenticates: sessions belong to x509:<subject>.
    let c = builder(&target)
        .tls(tls().identity(pki.path("trainer.pem"), pki.path("trainer.key")))
        .connect()
        .expect("mTLS with a certificate of the clients' CA");
    let s = c.create_session(&spec()).unwrap();
    let listed = c.list_sessions().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].owner, "x509:CN=rust-trainer");
    // The same identity given as PEM bytes is the same principal.
    let pem = |n: &str| std::fs::read(pki.path(n)).unwrap();
    let c2 = builder(&target).tls(tls().identity_pem(pem("trainer.pem"), pem("trainer.key"))).connect().unwrap();
    assert_eq!(c2.list_sessions().unwrap().len(), 1);
    drop(s);

    // Without a client certificate (and without a token) the call is refused.
    let e = builder(&target).tls(tls()).connect().unwrap().list_sessions().unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    // ... with the token it is served (another principal: it sees none of the trainer's sessions).
    let t = builder(&target).tls(tls()).bearer_token(TOKEN).connect().unwrap();
    let mine = t.create_session(&spec()).unwrap();
    let listed = t.list_sessions().unwrap();
    assert_eq!(listed.iter().map(|s| s.owner.as_str()).collect::<Vec<_>>(), vec!["rust-tls"]);
    let e = t
        .rpc()
        .step(proto::StepRequest { session_id: mine.id().to_string(), step_index: 1, ..Default::default() })
        .err();
    // (Its own session, no gradients pushed: any answer but an authentication error.)
    assert!(e.map_or(true, |e| e.code() != Code::Unauthenticated && e.code() != Code::PermissionDenied));

    // A certificate of a CA the daemon does not trust: refused by the daemon, as a TLS failure
    // (TLS 1.3 delivers the verdict after the handshake, so at connect or at the first call).
    let rogue = builder(&target).tls(tls().identity(pki.path("rogue.pem"), pki.path("rogue.key"))).connect();
    let e = match rogue {
        Err(e) => e,
        Ok(c) => c.list_sessions().expect_err("a client certificate of an untrusted CA must be refused"),
    };
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(e.tls_failure(), Some(TlsFailure::ClientCertificateRejected), "{e}");
    assert!(!e.is_transient());

    // A key file that holds no key, and a certificate file that holds none.
    let e =
        builder(&target).tls(tls().identity(pki.path("trainer.pem"), pki.path("trainer.pem"))).connect().err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("no PEM private key") && e.message().contains("trainer.pem"), "{e}");
    let e =
        builder(&target).tls(tls().identity(pki.path("trainer.key"), pki.path("trainer.key"))).connect().err().unwrap();
    assert!(e.message().contains("no PEM certificate"), "{e}");
}

#[test]
fn tls_to_a_plaintext_listener_fails_the_handshake() {
    let pki = Pki::new();
    pki.ca("ca");
    let d = Daemon::start(&[&token_flag(&pki.dir)], true);
    let target = tcp_target(&d);
    let e = builder(&target)
        .tls(TlsConfig::new().ca_file(pki.path("ca.pem")).server_name("localhost"))
        .bearer_token(TOKEN)
        .connect()
        .err()
        .expect("a plaintext listener cannot complete a TLS handshake");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("TLS") && e.message().contains(&target), "{e}");
    // The same daemon in plaintext with the token serves the call.
    assert!(builder(&target).bearer_token(TOKEN).connect().unwrap().list_sessions().unwrap().is_empty());
}
