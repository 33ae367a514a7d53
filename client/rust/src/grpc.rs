//! The gRPC wire protocol over hyper's HTTP/2 client, and nothing else.
//!
//! Debian 12 has no `tonic`, so this module frames gRPC by hand (the protocol is
//! <https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md>):
//! - a message is a 5-byte prefix (compressed flag 0, big-endian u32 length) and the protobuf
//!   bytes; [`encode_frame`] and [`FrameDecoder`];
//! - requests are `POST /<service>/<method>` with `content-type: application/grpc`,
//!   `te: trailers` and, with a deadline, `grpc-timeout` ([`timeout_header`]);
//! - the outcome is `grpc-status` / `grpc-message` (percent-encoded) in the trailers, or in the
//!   headers of a trailers-only response ([`status_from_headers`]); a non-200 HTTP status maps
//!   to a code as the protocol says ([`code_from_http`]).
//!
//! [`Channel`] makes unary, client-streaming and server-streaming calls of prost messages on
//! one HTTP/2 connection. The rest of the crate only uses [`Channel`]'s three call methods, so
//! replacing this module with `tonic` later is a local change.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::body::HttpBody;
use hyper::Body;
use prost::Message;

use crate::error::{Code, Error, Result};
use crate::transport::Connector;

/// Largest message this client accepts from the daemon (the daemon's own default limit is
/// smaller; this only bounds memory against a broken peer).
pub const MAX_RECEIVE_MESSAGE_BYTES: usize = 64 << 20;

/// The 5-byte length-prefixed frame of one message.
pub fn encode_frame<M: Message>(msg: &M) -> Bytes {
    let len = msg.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    msg.encode(&mut buf).expect("BytesMut grows");
    buf.freeze()
}

/// Splits a byte stream into gRPC message payloads (the prefix removed).
#[derive(Default)]
pub struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// Appends bytes as they arrive from the HTTP/2 body.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete message, `None` if more bytes are needed. A compressed frame or one
    /// over [`MAX_RECEIVE_MESSAGE_BYTES`] is an error (this client never asks for compression).
    pub fn next_frame(&mut self) -> Result<Option<Bytes>> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flag != 0 {
            return Err(Error::new(Code::Internal, format!("compressed gRPC frame (flag {flag}) not supported")));
        }
        if len > MAX_RECEIVE_MESSAGE_BYTES {
            return Err(Error::new(
                Code::ResourceExhausted,
                format!("gRPC message of {len} bytes exceeds the client limit of {MAX_RECEIVE_MESSAGE_BYTES}"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Bytes of an incomplete frame still buffered (non-zero at end of stream = truncated).
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The `grpc-timeout` value for `d`: at most 8 digits, in the finest unit that fits.
pub fn timeout_header(d: Duration) -> String {
    let nanos = d.as_nanos();
    const MAX: u128 = 99_999_999;
    for (div, unit) in [(1u128, 'n'), (1_000, 'u'), (1_000_000, 'm'), (1_000_000_000, 'S')] {
        let v = (nanos + div - 1) / div;
        if v <= MAX {
            return format!("{v}{unit}");
        }
    }
    let minutes = (nanos / 60_000_000_000).min(MAX);
    if minutes < MAX {
        return format!("{minutes}M");
    }
    format!("{}H", (nanos / 3_600_000_000_000).min(MAX))
}

/// Decodes `grpc-message`'s percent-encoding (invalid escapes are kept as they are).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status carried by `grpc-status`/`grpc-message` in `headers`, if any.
pub fn status_from_headers(headers: &HeaderMap) -> Option<Result<()>> {
    let status = headers.get("grpc-status")?;
    let code =
        status.to_str().ok().and_then(|s| s.trim().parse::<i32>().ok()).map(Code::from_i32).unwrap_or(Code::Unknown);
    if code == Code::Ok {
        return Some(Ok(()));
    }
    let message = headers.get("grpc-message").and_then(|v| v.to_str().ok()).map(percent_decode).unwrap_or_default();
    Some(Err(Error::new(code, message)))
}

/// The gRPC code for an HTTP status other than 200 (PROTOCOL-HTTP2.md / http-grpc-status-mapping).
pub fn code_from_http(status: u16) -> Code {
    match status {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

fn decode<M: Message + Default>(payload: Bytes) -> Result<M> {
    M::decode(payload).map_err(|e| Error::new(Code::Internal, format!("cannot decode the daemon's reply: {e}")))
}

/// The daemon over one pooled HTTP/2 connection (hyper re-opens it when it has closed;
/// concurrent calls are multiplexed on it). `metadata` goes on every request (e.g.
/// `authorization: Bearer ...`).
pub struct Channel {
    client: hyper::Client<Connector, Body>,
    connector: Connector,
    authority: String,
    metadata: Vec<(HeaderName, HeaderValue)>,
}

impl Channel {
    /// A channel over `connector`; `authority` is the `:authority` the requests carry.
    pub fn new(connector: Connector, authority: String, metadata: Vec<(HeaderName, HeaderValue)>) -> Channel {
        let client = hyper::Client::builder()
            .http2_only(true)
            // Tensor chunks are up to 4 MiB: windows of that size avoid a round trip per 64 KiB.
            .http2_initial_stream_window_size(4u32 << 20)
            .http2_initial_connection_window_size(8u32 << 20)
            .build(connector.clone());
        Channel { client, connector, authority, metadata }
    }

    fn request(&self, path: &str, body: Body, deadline: Option<Duration>) -> Result<http::Request<Body>> {
        let uri = format!("http://{}{}", self.authority, path);
        let mut b = http::Request::builder()
            .method(http::Method::POST)
            .uri(uri)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("user-agent", concat!("diond-rust/", env!("CARGO_PKG_VERSION")));
        if let Some(d) = deadline {
            b = b.header("grpc-timeout", timeout_header(d));
        }
        for (k, v) in &self.metadata {
            b = b.header(k, v);
        }
        b.body(body).map_err(|e| Error::new(Code::Internal, format!("cannot build request for {path}: {e}")))
    }

    /// Sends `requests` (client streaming; one element = unary) and hands every reply message
    /// to `on_reply` (server streaming; unary replies are one message). Returns the final status.
    async fn call<Req, Resp, I, F>(
        &self,
        path: &str,
        requests: I,
        deadline: Option<Duration>,
        on_reply: F,
    ) -> Result<()>
    where
        Req: Message,
        Resp: Message + Default,
        I: IntoIterator<Item = Req>,
        F: FnMut(Resp) -> Result<()>,
    {
        let work = self.call_inner(path, requests, deadline, on_reply);
        match deadline {
            None => work.await,
            Some(d) => {
                // The timer (1 ms granularity) cancels a call that runs over; a call that
                // finished, but only after its deadline, is reported as over too, as gRPC
                // defines it (the daemon may still have carried it out).
                let start = std::time::Instant::now();
                let exceeded = || Error::new(Code::DeadlineExceeded, format!("{path}: deadline of {d:?} exceeded"));
                match tokio::time::timeout(d, work).await {
                    Ok(_) if start.elapsed() > d => Err(exceeded()),
                    Ok(r) => r,
                    Err(_) => Err(exceeded()),
                }
            }
        }
    }

    async fn call_inner<Req, Resp, I, F>(
        &self,
        path: &str,
        requests: I,
        deadline: Option<Duration>,
        mut on_reply: F,
    ) -> Result<()>
    where
        Req: Message,
        Resp: Message + Default,
        I: IntoIterator<Item = Req>,
        F: FnMut(Resp) -> Result<()>,
    {
        let (mut tx, body) = Body::channel();
        let req = self.request(path, body, deadline)?;
        let response = self.client.request(req);
        // Frames are encoded one at a time as the HTTP/2 stream takes them (the body channel
        // holds one), so a long stream never sits in memory twice. If the daemon answers early
        // (an error), sending stops and the response's status is what counts.
        let send = async move {
            for m in requests {
                if tx.send_data(encode_frame(&m)).await.is_err() {
                    break;
                }
            }
            drop(tx); // END_STREAM
        };
        let (resp, ()) = tokio::join!(response, send);
        let resp = resp.map_err(|e| self.transport_error(e))?;
        let http_status = resp.status();
        if let Some(status) = status_from_headers(resp.headers()) {
            // A trailers-only response: no messages follow.
            return status;
        }
        if http_status != http::StatusCode::OK {
            return Err(Error::new(
                code_from_http(http_status.as_u16()),
                format!("HTTP status {http_status} from the daemon"),
            ));
        }
        let mut body = resp.into_body();
        let mut decoder = FrameDecoder::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| self.transport_error(e))?;
            decoder.push(&chunk);
            while let Some(payload) = decoder.next_frame()? {
                on_reply(decode::<Resp>(payload)?)?;
            }
        }
        if decoder.pending() != 0 {
            return Err(Error::new(Code::Internal, format!("the reply stream of {path} ended inside a message")));
        }
        let trailers = body.trailers().await.map_err(|e| self.transport_error(e))?;
        match trailers.as_ref().and_then(status_from_headers) {
            Some(status) => status,
            None => Err(Error::new(Code::Internal, format!("{path}: the daemon sent no grpc-status"))),
        }
    }

    /// A unary call.
    pub async fn unary<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        req: Req,
        deadline: Option<Duration>,
    ) -> Result<Resp> {
        // On the wire a unary call is a client-streaming call of one message.
        self.client_streaming(path, std::iter::once(req), deadline).await
    }

    /// A client-streaming call: all of `requests`, then one reply.
    pub async fn client_streaming<Req, Resp, I>(
        &self,
        path: &str,
        requests: I,
        deadline: Option<Duration>,
    ) -> Result<Resp>
    where
        Req: Message,
        Resp: Message + Default,
        I: IntoIterator<Item = Req>,
    {
        let mut reply: Option<Resp> = None;
        self.call(path, requests, deadline, |m: Resp| {
            if reply.is_some() {
                return Err(Error::new(
                    Code::Internal,
                    format!("{path}: more than one reply to a call that expects one"),
                ));
            }
            reply = Some(m);
            Ok(())
        })
        .await?;
        reply.ok_or_else(|| Error::new(Code::Internal, format!("{path}: OK without a reply message")))
    }

    /// A server-streaming call: `on_reply` sees every message in order; an error it returns
    /// cancels the call.
    pub async fn server_streaming<Req, Resp, F>(
        &self,
        path: &str,
        req: Req,
        deadline: Option<Duration>,
        on_reply: F,
    ) -> Result<()>
    where
        Req: Message,
        Resp: Message + Default,
        F: FnMut(Resp) -> Result<()>,
    {
        self.call(path, std::iter::once(req), deadline, on_reply).await
    }
}

impl Channel {
    /// [`transport_error`], with TLS alerts on this channel's connection kept as TLS failures.
    fn transport_error(&self, e: hyper::Error) -> Error {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = source {
            if let Some(tls) = self.connector.tls_error_in(s) {
                return tls;
            }
            source = s.source();
        }
        transport_error(e)
    }
}

/// A connection-level failure: the daemon went away or never answered (gRPC's `UNAVAILABLE`).
/// A failure of the connector (e.g. a refused TLS handshake) is returned as it is; otherwise the
/// message carries hyper's error and its causes.
pub fn transport_error(e: hyper::Error) -> Error {
    let mut message = format!("connection to the daemon failed: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        if let Some(own) = s.downcast_ref::<Error>() {
            return own.clone();
        }
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::new(Code::Unavailable, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Probe {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(bytes = "vec", tag = "2")]
        data: Vec<u8>,
    }

    #[test]
    fn frame_prefix_is_flag_and_big_endian_length() {
        let m = Probe { name: "w".into(), data: vec![7; 300] };
        let f = encode_frame(&m);
        assert_eq!(f[0], 0);
        let len = u32::from_be_bytes([f[1], f[2], f[3], f[4]]) as usize;
        assert_eq!(len, m.encoded_len());
        assert_eq!(f.len(), 5 + len);
        assert_eq!(Probe::decode(&f[5..]).unwrap(), m);
    }

    #[test]
    fn decoder_reassembles_frames_split_anywhere() {
        let msgs: Vec<Probe> = (0..5).map(|i| Probe { name: format!("t{i}"), data: vec![i as u8; i * 97] }).collect();
        let mut wire = Vec::new();
        for m in &msgs {
            wire.extend_from_slice(&encode_frame(m));
        }
        for piece in [1usize, 2, 5, 7, 64, wire.len()] {
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            for part in wire.chunks(piece) {
                d.push(part);
                while let Some(p) = d.next_frame().unwrap() {
                    got.push(Probe::decode(p).unwrap());
                }
            }
            assert_eq!(got, msgs, "pieces of {piece} bytes");
            assert_eq!(d.pending(), 0);
        }
    }

    #[test]
    fn decoder_keeps_a_partial_frame_pending_and_rejects_compression_and_huge_lengths() {
        let mut d = FrameDecoder::new();
        d.push(&[0, 0, 0, 0, 10, 1, 2]);
        assert!(d.next_frame().unwrap().is_none());
        assert_eq!(d.pending(), 7);
        let mut c = FrameDecoder::new();
        c.push(&[1, 0, 0, 0, 0]);
        assert_eq!(c.next_frame().unwrap_err().code(), Code::Internal);
        let mut h = FrameDecoder::new();
        h.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(h.next_frame().unwrap_err().code(), Code::ResourceExhausted);
    }

    #[test]
    fn timeout_header_uses_at_most_eight_digits() {
        assert_eq!(timeout_header(Duration::from_nanos(1)), "1n");
        assert_eq!(timeout_header(Duration::from_millis(250)), "250000u");
        assert_eq!(timeout_header(Duration::from_secs(5)), "5000000u");
        assert_eq!(timeout_header(Duration::from_secs(100)), "100000m");
        assert_eq!(timeout_header(Duration::from_secs(200_000)), "200000S");
        assert_eq!(timeout_header(Duration::from_secs(100_000_000 * 60)), "1666666H");
        for d in [Duration::from_micros(1234567), Duration::from_secs(3600 * 24 * 400)] {
            let h = timeout_header(d);
            assert!(h.len() <= 9, "{h}");
            // Never shorter than asked: the daemon must not give up before the client does.
            let (num, unit) = h.split_at(h.len() - 1);
            let n: u128 = num.parse().unwrap();
            let scale: u128 = match unit {
                "n" => 1,
                "u" => 1_000,
                "m" => 1_000_000,
                "S" => 1_000_000_000,
                "M" => 60_000_000_000,
                _ => 3_600_000_000_000,
            };
            assert!(n * scale >= d.as_nanos() || unit == "M" || unit == "H", "{h} for {d:?}");
        }
    }

    #[test]
    fn grpc_message_is_percent_decoded() {
        assert_eq!(percent_decode("step_index%3A 3 expected 2"), "step_index: 3 expected 2");
        assert_eq!(percent_decode("caf%C3%A9 100%"), "café 100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn status_comes_from_grpc_status_and_message() {
        let mut h = HeaderMap::new();
        assert!(status_from_headers(&h).is_none());
        h.insert("grpc-status", HeaderValue::from_static("0"));
        assert!(status_from_headers(&h).unwrap().is_ok());
        h.insert("grpc-status", HeaderValue::from_static("5"));
        h.insert("grpc-message", HeaderValue::from_static("session %22x%22 not found"));
        let e = status_from_headers(&h).unwrap().unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        assert_eq!(e.message(), "session \"x\" not found");
        h.insert("grpc-status", HeaderValue::from_static("banana"));
        assert_eq!(status_from_headers(&h).unwrap().unwrap_err().code(), Code::Unknown);
    }

    #[test]
    fn http_status_maps_as_the_protocol_says() {
        assert_eq!(code_from_http(401), Code::Unauthenticated);
        assert_eq!(code_from_http(404), Code::Unimplemented);
        assert_eq!(code_from_http(503), Code::Unavailable);
        assert_eq!(code_from_http(500), Code::Unknown);
    }
}
