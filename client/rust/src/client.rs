//! The connection to a daemon: [`Client`] (blocking; it owns a small tokio runtime) and its
//! typed RPC stubs ([`Rpc`]).

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};

use crate::error::{Code, Error, Result};
use crate::grpc::Channel;
use crate::proto;
use crate::session::Session;
use crate::spec::SessionSpec;
use crate::tls::TlsConfig;
use crate::transport::{Connector, Endpoint};

const SERVICE: &str = "/diond.v1.Optimizer/";
/// The longest `connect` waits for the first connection (less with a shorter call timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

struct Shared {
    // Field order: the channel (and its connection tasks) go before the runtime that runs them.
    channel: Channel,
    rt: tokio::runtime::Runtime,
    endpoint: Endpoint,
}

/// Options of [`Client`]: the per-call deadline, request metadata (the bearer token), TLS.
pub struct ClientBuilder {
    target: String,
    timeout: Option<Duration>,
    metadata: Vec<(String, String)>,
    tls: Option<TlsConfig>,
    token_file: Option<std::path::PathBuf>,
}

impl ClientBuilder {
    /// The deadline of every call (sent as `grpc-timeout` and enforced here). Default: none,
    /// as in gRPC.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }
    /// A header sent with every call (for the token, prefer [`ClientBuilder::bearer_token`]).
    pub fn metadata(mut self, key: &str, value: &str) -> Self {
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }
    /// Sends `authorization: Bearer <token>` with every call, the header the daemon's token
    /// authentication (`--auth_token_file`) reads on TCP. Without TLS the token crosses the
    /// network in clear text: use it on loopback, or with [`ClientBuilder::tls`].
    pub fn bearer_token(self, token: &str) -> Self {
        let t = format!("Bearer {}", token.trim());
        self.metadata("authorization", &t)
    }
    /// [`ClientBuilder::bearer_token`] with the token read from a file at `connect` (blanks
    /// around it stripped), e.g. a mounted secret; an unreadable or empty file is
    /// `InvalidArgument`.
    pub fn bearer_token_file(mut self, path: impl AsRef<std::path::Path>) -> Self {
        self.token_file = Some(path.as_ref().to_path_buf());
        self
    }
    /// Speaks TLS to a TCP target (module [`crate::tls`]): the daemon's certificate is checked
    /// against the CA of `tls`, and its client certificate, if any, is presented.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }
    /// Connects now: an absent daemon is an `Unavailable` error here, not at the first call
    /// (after at most 20 s, or the call timeout if shorter, for a host that does not answer),
    /// and so is a refused TLS handshake (with [`Error::tls_failure`] saying why). TLS files and
    /// the token file are read here; their mistakes are `InvalidArgument`.
    pub fn connect(mut self) -> Result<Client> {
        let endpoint = Endpoint::parse(&self.target)?;
        if let Some(path) = self.token_file.take() {
            let shown: String = path.display().to_string().chars().take(200).collect();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::invalid(format!("cannot read the token file '{shown}': {e}")))?;
            if text.trim().is_empty() {
                return Err(Error::invalid(format!("the token file '{shown}' is empty")));
            }
            self = self.bearer_token(text.trim());
        }
        let connector = match &self.tls {
            None => Connector::new(endpoint.clone()),
            Some(tls) => Connector::with_tls(endpoint.clone(), tls)?,
        };
        let mut metadata = Vec::with_capacity(self.metadata.len());
        for (k, v) in &self.metadata {
            let name = HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes()).map_err(|_| {
                Error::invalid(format!(
                    "metadata key '{}' is not a header name",
                    k.chars().take(100).collect::<String>()
                ))
            })?;
            let value = HeaderValue::from_str(v)
                .map_err(|_| Error::invalid(format!("metadata value of '{name}' is not a header value")))?;
            metadata.push((name, value));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("diond-client")
            .enable_all()
            .build()
            .map_err(|e| Error::new(Code::Internal, format!("cannot start the client runtime: {e}")))?;
        let probe = connector.clone();
        let shown: String = self.target.chars().take(200).collect();
        let wait = self.timeout.unwrap_or(CONNECT_TIMEOUT).min(CONNECT_TIMEOUT);
        match rt.block_on(async move { tokio::time::timeout(wait, probe.probe()).await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(Error::new(
                    Code::Unavailable,
                    format!("cannot reach the daemon at {shown}: no answer in {wait:?}"),
                ))
            }
        }
        let channel = {
            let _guard = rt.enter();
            Channel::new(connector, endpoint.authority(), metadata)
        };
        Ok(Client { shared: Arc::new(Shared { channel, rt, endpoint }), timeout: self.timeout })
    }
}

/// A blocking client of one daemon. Cheap to clone (clones share the connection). Not for use
/// from inside an async runtime: each call blocks the calling thread.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
    timeout: Option<Duration>,
}

impl Client {
    /// Connects to `target`: `unix:/run/diond.sock` or `host:port` (transport.rs), without TLS or
    /// token; see [`Client::builder`] for those.
    pub fn connect(target: &str) -> Result<Client> {
        Client::builder(target).connect()
    }

    pub fn builder(target: &str) -> ClientBuilder {
        ClientBuilder { target: target.to_string(), timeout: None, metadata: Vec::new(), tls: None, token_file: None }
    }

    /// The same connection with another per-call deadline.
    pub fn with_timeout(&self, d: Option<Duration>) -> Client {
        Client { shared: self.shared.clone(), timeout: d }
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.shared.endpoint
    }

    /// The typed stubs, one method per RPC of `diond.v1.Optimizer`, taking and returning the
    /// proto messages.
    pub fn rpc(&self) -> Rpc<'_> {
        Rpc { client: self }
    }

    /// Declares a session (validated in full by the daemon before anything is allocated).
    pub fn create_session(&self, spec: &SessionSpec) -> Result<Session> {
        let created = self.rpc().create_session(spec.request().clone())?;
        Ok(Session::new(self.clone(), created))
    }

    /// Restores a checkpoint as a new session; also returns its last applied step index.
    /// Attach shared memory with [`Session::attach_shm`]: the restored weights land in it.
    pub fn load_checkpoint(&self, path: &str) -> Result<(Session, i64)> {
        let r = self
            .rpc()
            .load_checkpoint(proto::LoadCheckpointRequest { path: path.to_string(), ..Default::default() })?;
        let step = r.step_index;
        let created =
            r.session.ok_or_else(|| Error::new(Code::Internal, "LoadCheckpoint answered without a session"))?;
        Ok((Session::new(self.clone(), created), step))
    }

    pub fn list_sessions(&self) -> Result<Vec<proto::SessionInfo>> {
        Ok(self.rpc().list_sessions(proto::ListSessionsRequest {})?.sessions)
    }

    /// The daemon's option table: every field of `Hyperparameters` with its type, range and
    /// algorithms, and every algorithm's defaults. The builders of `spec.rs` keep no copy of
    /// these: the daemon fills unset fields with the defaults and refuses values out of range.
    pub fn describe_options(&self) -> Result<proto::DescribeOptionsResponse> {
        self.rpc().describe_options(proto::DescribeOptionsRequest {})
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.shared.rt.block_on(f)
    }
}

/// The RPCs of `diond.v1.Optimizer` with proto messages; [`Session`] is built on these.
pub struct Rpc<'a> {
    client: &'a Client,
}

macro_rules! unary {
    ($fn:ident, $method:literal, $req:ty, $resp:ty) => {
        pub fn $fn(&self, req: $req) -> Result<$resp> {
            let c = self.client;
            c.block_on(c.shared.channel.unary(concat!("/diond.v1.Optimizer/", $method), req, c.timeout))
        }
    };
}

impl<'a> Rpc<'a> {
    unary!(create_session, "CreateSession", proto::CreateSessionRequest, proto::CreateSessionResponse);
    unary!(register_region, "RegisterRegion", proto::RegisterRegionRequest, proto::RegisterRegionResponse);
    unary!(unregister_region, "UnregisterRegion", proto::UnregisterRegionRequest, proto::UnregisterRegionResponse);
    unary!(step, "Step", proto::StepRequest, proto::StepResponse);
    unary!(
        set_hyperparameters,
        "SetHyperparameters",
        proto::SetHyperparametersRequest,
        proto::SetHyperparametersResponse
    );
    unary!(save_checkpoint, "SaveCheckpoint", proto::SaveCheckpointRequest, proto::SaveCheckpointResponse);
    unary!(load_checkpoint, "LoadCheckpoint", proto::LoadCheckpointRequest, proto::LoadCheckpointResponse);
    unary!(close_session, "CloseSession", proto::CloseSessionRequest, proto::CloseSessionResponse);
    unary!(list_sessions, "ListSessions", proto::ListSessionsRequest, proto::ListSessionsResponse);
    unary!(describe_options, "DescribeOptions", proto::DescribeOptionsRequest, proto::DescribeOptionsResponse);

    /// Client streaming: `chunks` are sent as the stream takes them.
    pub fn push_gradients<I: IntoIterator<Item = proto::TensorChunk>>(
        &self,
        chunks: I,
    ) -> Result<proto::PushGradientsResponse> {
        let c = self.client;
        c.block_on(c.shared.channel.client_streaming(&format!("{SERVICE}PushGradients"), chunks, c.timeout))
    }

    /// Client streaming.
    pub fn set_state<I: IntoIterator<Item = proto::TensorChunk>>(&self, chunks: I) -> Result<proto::SetStateResponse> {
        let c = self.client;
        c.block_on(c.shared.channel.client_streaming(&format!("{SERVICE}SetState"), chunks, c.timeout))
    }

    /// Server streaming: `on_chunk` sees every chunk in order (an error it returns cancels).
    pub fn pull_parameters<F: FnMut(proto::TensorChunk) -> Result<()>>(
        &self,
        req: proto::PullParametersRequest,
        on_chunk: F,
    ) -> Result<()> {
        let c = self.client;
        c.block_on(c.shared.channel.server_streaming(&format!("{SERVICE}PullParameters"), req, c.timeout, on_chunk))
    }

    /// Server streaming.
    pub fn get_state<F: FnMut(proto::TensorChunk) -> Result<()>>(
        &self,
        req: proto::GetStateRequest,
        on_chunk: F,
    ) -> Result<()> {
        let c = self.client;
        c.block_on(c.shared.channel.server_streaming(&format!("{SERVICE}GetState"), req, c.timeout, on_chunk))
    }
}
