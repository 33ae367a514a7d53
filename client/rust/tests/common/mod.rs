//! Test harness: starts the real `diond` (path from $DIOND_BINARY, default
//! <repo>/build/bin/diond) on a Unix socket in a fresh temporary folder, optionally also on a
//! loopback TCP port, waits for its ready file, and kills it on drop. Also reads safetensors
//! files (the conformance vectors).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diond::Client;

/// The repository root (client/rust/../..).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

pub fn diond_binary() -> PathBuf {
    match std::env::var_os("DIOND_BINARY") {
        Some(p) => PathBuf::from(p),
        None => repo_root().join("build/bin/diond"),
    }
}

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "diond-rs-{tag}-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub struct Daemon {
    child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub tcp_port: Option<u16>,
}

impl Daemon {
    /// Starts diond with --listen=unix:<dir>/d.sock[,127.0.0.1:0] --metrics_address=
    /// --device=cpu --ready_file=<dir>/ready.json plus `flags`. Panics (with the log) if it is
    /// not ready within 60 s.
    pub fn start(flags: &[&str], tcp: bool) -> Daemon {
        let bin = diond_binary();
        assert!(
            bin.exists(),
            "no daemon binary at {} (build the repository first: scripts/build.sh, or set DIOND_BINARY)",
            bin.display()
        );
        let dir = temp_dir("daemon");
        let socket = dir.join("d.sock");
        let ready = dir.join("ready.json");
        let log = std::fs::File::create(dir.join("log.txt")).expect("log file");
        let mut listen = format!("--listen=unix:{}", socket.display());
        if tcp {
            listen.push_str(",127.0.0.1:0");
        }
        let child = Command::new(&bin)
            .arg(listen)
            .arg("--metrics_address=")
            .arg("--device=cpu")
            .arg(format!("--ready_file={}", ready.display()))
            .args(flags)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut d = Daemon { child, dir, socket, tcp_port: None };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                if let Ok(j) = serde_json::from_str::<serde_json::Value>(&text) {
                    if let Some(list) = j.get("listen").and_then(|l| l.as_array()) {
                        for e in list {
                            if let Some(p) = e.get("port").and_then(|p| p.as_u64()) {
                                d.tcp_port = Some(p as u16);
                            }
                        }
                        return d;
                    }
                }
            }
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!("diond exited with {status} before it was ready; log:\n{}", d.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("diond was not ready within 60 s; log:\n{}", d.log());
    }

    pub fn target(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    pub fn client(&self) -> Client {
        Client::builder(&self.target()).timeout(Duration::from_secs(120)).connect().expect("connect to the test daemon")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log.txt")).unwrap_or_default()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Names of this process's shm segments still in /dev/shm.
pub fn leftover_segments() -> Vec<String> {
    let prefix = format!("{}{}-", diond::shm::SEGMENT_PREFIX, std::process::id());
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/dev/shm") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&prefix) {
                out.push(n);
            }
        }
    }
    out
}

// ---- safetensors (https://github.com/huggingface/safetensors, the format of the vectors) ------

pub struct Safetensors {
    pub metadata: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, (Vec<i64>, Vec<f32>)>,
}

impl Safetensors {
    /// Reads a file of F32 tensors (the only dtype the conformance vectors use).
    pub fn read(path: &Path) -> Safetensors {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("safetensors header");
        let data = &bytes[8 + n..];
        let mut metadata = BTreeMap::new();
        let mut tensors = BTreeMap::new();
        for (k, v) in header.as_object().expect("header object") {
            if k == "__metadata__" {
                for (mk, mv) in v.as_object().expect("metadata object") {
                    metadata.insert(mk.clone(), mv.as_str().expect("metadata values are strings").to_string());
                }
                continue;
            }
            assert_eq!(v["dtype"], "F32", "{}: tensor {k}", path.display());
            let shape: Vec<i64> = v["shape"].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect();
            let off = v["data_offsets"].as_array().unwrap();
            let (a, b) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
            let vals = data[a..b].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            tensors.insert(k.clone(), (shape, vals));
        }
        Safetensors { metadata, tensors }
    }

    pub fn get(&self, name: &str) -> &[f32] {
        &self.tensors.get(name).unwrap_or_else(|| panic!("no tensor {name}")).1
    }
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// ||a - b||_F / ||b||_F in double.
pub fn rel_fro(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = *x as f64 - *y as f64;
        num += d * d;
        den += (*y as f64) * (*y as f64);
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Panics naming the first differing element (never printing whole tensors) unless `a` and `b`
/// are the same floats bit for bit.
pub fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        let n = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).count();
        panic!("{what}: {n} of {} elements differ; first at {i}: {:e} vs {:e}", a.len(), a[i], b[i]);
    }
}

/// A Unix-socket proxy in front of a daemon that can lose one answer: after
/// [`Proxy::lose_next_answer`], the first bytes the daemon sends back are dropped and that
/// connection is cut, as when a network fails after the daemon has done the work.
pub struct Proxy {
    pub path: PathBuf,
    lose: std::sync::Arc<std::sync::atomic::AtomicBool>,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub fn start(daemon_socket: &Path, dir: &Path) -> Proxy {
        use std::os::unix::net::{UnixListener, UnixStream};
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let path = dir.join("proxy.sock");
        let listener = UnixListener::bind(&path).expect("bind the proxy");
        let lose = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (l2, s2, c2, target) = (lose.clone(), stop.clone(), connections.clone(), daemon_socket.to_path_buf());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s2.load(Ordering::SeqCst) {
                    break;
                }
                let client = match client {
                    Ok(c) => c,
                    Err(_) => continue,
                };
                let daemon = match UnixStream::connect(&target) {
                    Ok(d) => d,
                    Err(_) => continue,
                };
                c2.fetch_add(1, Ordering::SeqCst);
                let (mut c_in, mut d_out) = (client.try_clone().unwrap(), daemon.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c_in, &mut d_out);
                });
                let lose = l2.clone();
                std::thread::spawn(move || {
                    use std::io::{Read, Write};
                    let (mut d_in, mut c_out) = (daemon, client);
                    let mut buf = vec![0u8; 1 << 16];
                    loop {
                        let n = match d_in.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if lose.swap(false, Ordering::SeqCst) {
                            break; // drop these bytes and cut the connection
                        }
                        if c_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = d_in.shutdown(std::net::Shutdown::Both);
                    let _ = c_out.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Proxy { path, lose, connections, stop }
    }

    pub fn target(&self) -> String {
        format!("unix:{}", self.path.display())
    }
    pub fn lose_next_answer(&self) {
        self.lose.store(true, Ordering::SeqCst);
    }
    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::os::unix::net::UnixStream::connect(&self.path); // wakes the accept loop
    }
}
