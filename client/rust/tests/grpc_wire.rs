//! The gRPC framing module against a scripted HTTP/2 peer (the `h2` crate's server on a Unix
//! socket): what goes on the wire (path, content-type, te, grpc-timeout, metadata such as a
//! bearer token, length-prefixed frames) and how every kind of answer maps to a result,
//! including the ones the real daemon does not produce on demand (trailers-only statuses,
//! non-200 HTTP, missing grpc-status, compressed or truncated frames, a peer that never answers).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use diond::grpc::{encode_frame, FrameDecoder};
use diond::{proto, Client, Code};
use http::{HeaderMap, HeaderValue};

#[derive(Clone, Debug)]
struct Seen {
    path: String,
    headers: HeaderMap,
    body: Vec<u8>,
}

fn respond_headers(status: u16) -> http::Response<()> {
    http::Response::builder().status(status).header("content-type", "application/grpc").body(()).unwrap()
}

fn trailers(status: &str) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_str(status).unwrap());
    t
}

async fn handle(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    let (parts, mut body) = req.into_parts();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(_) => return,
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    seen.lock().unwrap().push(Seen {
        path: parts.uri.path().to_string(),
        headers: parts.headers.clone(),
        body: bytes.clone(),
    });
    let case = parts.headers.get("x-case").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let list = proto::ListSessionsResponse {
        sessions: vec![proto::SessionInfo { session_id: "s1".into(), client_name: "c".into(), ..Default::default() }],
    };
    match case.as_str() {
        "ok" => {
            // One message split over two DATA frames, inside its 5-byte prefix.
            let f = encode_frame(&list);
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(f.slice(..3), false).unwrap();
            s.send_data(f.slice(3..), false).unwrap();
            s.send_trailers(trailers("0")).unwrap();
        }
        "trailers-only" => {
            let r = http::Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .header("grpc-status", "7")
                .header("grpc-message", "no%20way%20%E2%9C%93")
                .body(())
                .unwrap();
            respond.send_response(r, true).unwrap();
        }
        "http-503" => {
            respond.send_response(http::Response::builder().status(503).body(()).unwrap(), true).unwrap();
        }
        "no-status" => {
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(encode_frame(&list), false).unwrap();
            s.send_trailers(HeaderMap::new()).unwrap();
        }
        "compressed" => {
            let mut f = encode_frame(&list).to_vec();
            f[0] = 1;
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(Bytes::from(f), false).unwrap();
            s.send_trailers(trailers("0")).unwrap();
        }
        "truncated" => {
            let f = encode_frame(&list);
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(f.slice(..f.len() - 1), false).unwrap();
            s.send_trailers(trailers("0")).unwrap();
        }
        "two-replies" => {
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(encode_frame(&list), false).unwrap();
            s.send_data(encode_frame(&list), false).unwrap();
            s.send_trailers(trailers("0")).unwrap();
        }
        "stall" => {
            // Never answers; the client's deadline must end the call (dropping this task).
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        "stream" => {
            // Three tensors' chunks, the byte stream cut into 7-byte DATA frames.
            let mut wire = Vec::new();
            for (name, data) in [("a", vec![1u8, 2, 3, 4]), ("b", vec![5u8; 8]), ("c", vec![])] {
                let c = proto::TensorChunk {
                    name: name.into(),
                    data: data.clone(),
                    total_bytes: data.len() as i64,
                    shape: vec![data.len() as i64 / 4],
                    dtype: proto::DType::DtypeF32 as i32,
                    ..Default::default()
                };
                wire.extend_from_slice(&encode_frame(&c));
            }
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            for piece in wire.chunks(7) {
                s.send_data(Bytes::copy_from_slice(piece), false).unwrap();
            }
            s.send_trailers(trailers("0")).unwrap();
        }
        "count" => {
            // Echoes what a client stream carried, decoded here independently of the client.
            let mut d = FrameDecoder::new();
            d.push(&bytes);
            let (mut chunks, mut received) = (0, 0);
            while let Some(p) = d.next_frame().unwrap() {
                let c = <proto::TensorChunk as prost::Message>::decode(p).unwrap();
                chunks += 1;
                received += c.data.len() as i64;
            }
            let reply = proto::PushGradientsResponse { bytes_received: received, chunks };
            let mut s = respond.send_response(respond_headers(200), false).unwrap();
            s.send_data(encode_frame(&reply), false).unwrap();
            s.send_trailers(trailers("0")).unwrap();
        }
        _ => {
            respond.send_response(respond_headers(200), false).unwrap().send_trailers(trailers("12")).unwrap();
        }
    }
}

/// Serves the scripted peer on `path` from its own thread and runtime.
fn serve(path: &Path) -> Arc<Mutex<Vec<Seen>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (path, s2) = (path.to_path_buf(), seen.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&path).unwrap();
            ready_tx.send(()).unwrap();
            loop {
                let (sock, _) = match listener.accept().await {
                    Ok(s) => s,
                    Err(_) => return,
                };
                let seen = s2.clone();
                tokio::spawn(async move {
                    let mut conn = match h2::server::handshake(sock).await {
                        Ok(c) => c,
                        Err(_) => return, // e.g. the client's connect probe
                    };
                    while let Some(Ok((req, respond))) = conn.accept().await {
                        tokio::spawn(handle(req, respond, seen.clone()));
                    }
                });
            }
        });
    });
    ready_rx.recv().unwrap();
    seen
}

fn client(sock: &PathBuf, case: &str) -> Client {
    Client::builder(&format!("unix:{}", sock.display()))
        .metadata("x-case", case)
        .bearer_token("t0ken\n")
        .timeout(Duration::from_secs(5))
        .connect()
        .unwrap()
}

#[test]
fn requests_carry_the_grpc_headers_metadata_and_frames() {
    let dir = common::temp_dir("wire");
    let sock = dir.join("peer.sock");
    let seen = serve(&sock);
    let sessions = client(&sock, "ok").list_sessions().unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].session_id, "s1");
    let s = seen.lock().unwrap()[0].clone();
    assert_eq!(s.path, "/diond.v1.Optimizer/ListSessions");
    assert_eq!(s.headers["content-type"], "application/grpc");
    assert_eq!(s.headers["te"], "trailers");
    assert_eq!(s.headers["authorization"], "Bearer t0ken");
    assert_eq!(s.headers["x-case"], "ok");
    // 5 s in the finest unit with at most 8 digits.
    assert_eq!(s.headers["grpc-timeout"], "5000000u");
    // An empty ListSessionsRequest is a frame of five bytes: flag 0 and length 0.
    assert_eq!(s.body, vec![0, 0, 0, 0, 0]);

    // Without a deadline no grpc-timeout is sent.
    let c = client(&sock, "ok").with_timeout(None);
    c.list_sessions().unwrap();
    assert!(seen.lock().unwrap().last().unwrap().headers.get("grpc-timeout").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_kind_of_answer_maps_to_its_result() {
    let dir = common::temp_dir("wire");
    let sock = dir.join("peer.sock");
    let _seen = serve(&sock);
    let err = |case: &str| client(&sock, case).list_sessions().unwrap_err();

    let e = err("trailers-only");
    assert_eq!(e.code(), Code::PermissionDenied);
    assert_eq!(e.message(), "no way ✓");
    assert_eq!(err("http-503").code(), Code::Unavailable);
    assert_eq!(err("no-status").code(), Code::Internal);
    assert_eq!(err("compressed").code(), Code::Internal);
    let e = err("truncated");
    assert_eq!(e.code(), Code::Internal);
    assert!(e.message().contains("ended inside a message"), "{e}");
    assert_eq!(err("two-replies").code(), Code::Internal);
    assert_eq!(err("unknown").code(), Code::Unimplemented);

    let hurried = client(&sock, "stall").with_timeout(Some(Duration::from_millis(200)));
    let e = hurried.list_sessions().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn streams_are_framed_and_reassembled() {
    let dir = common::temp_dir("wire");
    let sock = dir.join("peer.sock");
    let seen = serve(&sock);

    // Server streaming: messages cut at arbitrary byte boundaries come out whole and in order.
    let mut got = Vec::new();
    client(&sock, "stream")
        .rpc()
        .pull_parameters(proto::PullParametersRequest { session_id: "s".into(), ..Default::default() }, |c| {
            got.push((c.name, c.data));
            Ok(())
        })
        .unwrap();
    assert_eq!(
        got,
        vec![("a".to_string(), vec![1, 2, 3, 4]), ("b".to_string(), vec![5; 8]), ("c".to_string(), vec![])]
    );
    // An error from the callback cancels the call and is what the caller sees.
    let e = client(&sock, "stream")
        .rpc()
        .pull_parameters(proto::PullParametersRequest::default(), |_| Err(diond::Error::new(Code::Aborted, "enough")))
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);

    // Client streaming: 10 chunks of at most 3 bytes (plus an empty tensor), decoded by the peer.
    let data: Vec<u8> = (0..25).collect();
    let chunks: Vec<proto::TensorChunk> = data
        .chunks(3)
        .enumerate()
        .map(|(i, d)| proto::TensorChunk {
            name: "w".into(),
            offset_bytes: 3 * i as i64,
            data: d.to_vec(),
            ..Default::default()
        })
        .chain(std::iter::once(proto::TensorChunk { name: "e".into(), ..Default::default() }))
        .collect();
    let r = client(&sock, "count").rpc().push_gradients(chunks.clone()).unwrap();
    assert_eq!(r.chunks, 10);
    assert_eq!(r.bytes_received, 25);
    let last = seen.lock().unwrap().last().unwrap().clone();
    assert_eq!(last.path, "/diond.v1.Optimizer/PushGradients");
    let expected: Vec<u8> = chunks.iter().flat_map(|c| encode_frame(c).to_vec()).collect();
    assert_eq!(last.body, expected, "the request body is exactly the concatenated frames");
    let _ = std::fs::remove_dir_all(&dir);
}
