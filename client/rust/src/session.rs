//! One optimizer session on the daemon: steps, tensors in and out, state, checkpoints, and the
//! shared-memory arena. Closed on drop.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::client::Client;
use crate::error::{Code, Error, Result};
use crate::proto;
use crate::shm::ShmArena;
use crate::spec::Hyperparameters;
use crate::tensor::{chunks, f32_bytes, Reassembler, TensorMap, MAX_CHUNK_BYTES};

/// Options of one step beyond its index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOptions {
    /// Group name -> learning rate for this step only.
    pub lr_override: BTreeMap<String, f64>,
    /// Multiplies the gradients (0 = 1.0).
    pub gradient_scale: f64,
    /// Asynchronous Step (docs/DATA_PLANE.md): the daemon answers once the step is queued
    /// (`queued` set); the result comes with the next step (`previous`) or
    /// [`Session::wait_step`]. The arena belongs to the step until then: do not touch it.
    pub asynchronous: bool,
    /// The parameters (indices in the session's declaration order) without a gradient in this
    /// step, as torch.optim's `p.grad is None`: the step leaves them and their state alone.
    pub params_without_grad: Vec<i32>,
    /// Clips the gradients in the daemon to this total L2 norm first, as torch's
    /// `clip_grad_norm_` (docs/DATA_PLANE.md "Gradient clip"; 0 = no clip). The answer's
    /// `grad_norm` is the norm before the clip.
    pub max_grad_norm: f64,
}

/// How [`Session::step`] retries a step whose outcome it did not learn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all (1 = no retry).
    pub attempts: u32,
    /// Wait before the first retry; doubled for each further one.
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy { attempts: 4, backoff: Duration::from_millis(100) }
    }
}

/// A session. Dropping it closes it on the daemon (errors ignored; call [`Session::close`] to
/// see them), then unmaps and unlinks its shared memory.
pub struct Session {
    client: Client,
    id: String,
    layout: proto::CreateSessionResponse,
    arena: Option<ShmArena>,
    regions: Vec<String>,
    chunk_bytes: usize,
    retry: RetryPolicy,
    closed: bool,
}

impl Session {
    pub(crate) fn new(client: Client, layout: proto::CreateSessionResponse) -> Session {
        Session {
            client,
            id: layout.session_id.clone(),
            layout,
            arena: None,
            regions: Vec::new(),
            chunk_bytes: 1 << 20,
            retry: RetryPolicy::default(),
            closed: false,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }
    /// The daemon's layout answer (tensor offsets and arena sizes).
    pub fn layout(&self) -> &proto::CreateSessionResponse {
        &self.layout
    }
    pub fn client(&self) -> &Client {
        &self.client
    }
    /// Data bytes per streamed chunk (default 1 MiB; at most 4 MiB).
    pub fn set_chunk_bytes(&mut self, n: usize) {
        self.chunk_bytes = n.clamp(1, MAX_CHUNK_BYTES);
    }
    pub fn set_retry_policy(&mut self, p: RetryPolicy) {
        self.retry = p;
    }

    // ---- shared memory ------------------------------------------------------------------------

    /// Creates a POSIX shm arena for this session's layout and registers it (both roles). From
    /// then on [`Session::step`] reads the gradients from it and writes the parameters into it.
    pub fn attach_shm(&mut self) -> Result<&mut ShmArena> {
        self.check_detached()?;
        let arena = ShmArena::for_layout(&self.layout)?;
        let mut bodies = Vec::new();
        for region in [arena.param_region(), arena.grad_region()] {
            let region = region.expect("a POSIX shm arena has segments");
            bodies.push((proto::RegionKind::SystemShm, proto::register_region_request::Region::SystemShm(region)));
        }
        self.register(arena, |_, _| Ok(bodies.remove(0)))
    }

    /// [`Session::attach_shm`] with a sealed memfd (module [`crate::shm`]), sent to the daemon
    /// over its fd channel once per role (each `RegisterRegion` takes its own fd). Needs the
    /// daemon's Unix socket and a daemon that lists `REGION_KIND_MEMFD` with an fd channel
    /// (`FAILED_PRECONDITION` otherwise, before anything is created).
    pub fn attach_memfd(&mut self) -> Result<&mut ShmArena> {
        self.check_detached()?;
        let channel = self.fd_channel().ok_or_else(|| {
            Error::new(
                Code::FailedPrecondition,
                "this daemon takes no memfd regions (CreateSession listed no REGION_KIND_MEMFD with an fd \
                 channel): use attach_shm",
            )
        })?;
        let arena = ShmArena::memfd_for_layout(&self.layout)?;
        let timeout = self.client.timeout().unwrap_or(Duration::from_secs(20));
        self.register(arena, |arena, role| {
            let m = arena.memfd().expect("a memfd arena");
            let (param_bytes, grad_bytes) = arena.arena_bytes();
            let (offset, size) = match role {
                proto::RegionRole::Gradients => (m.grad_offset(), grad_bytes),
                _ => (0, param_bytes),
            };
            let token = crate::fdchannel::send_fd(&channel, m.fd(), crate::fdchannel::KIND_MEMFD, timeout)?;
            Ok((
                proto::RegionKind::Memfd,
                proto::register_region_request::Region::Memfd(proto::MemfdRegion {
                    offset_bytes: offset as i64,
                    size_bytes: size as i64,
                    fd_token: token,
                }),
            ))
        })
    }

    /// Attaches shared memory of the best kind this daemon takes: a memfd where it lists
    /// `REGION_KIND_MEMFD` with an fd channel this process can reach, else POSIX shm.
    pub fn attach(&mut self) -> Result<&mut ShmArena> {
        match self.fd_channel() {
            Some(path) if self.client.endpoint().host().is_none() && path.exists() => self.attach_memfd(),
            _ => self.attach_shm(),
        }
    }

    /// The daemon's fd channel, when it takes memfd regions.
    fn fd_channel(&self) -> Option<std::path::PathBuf> {
        let memfd = self.layout.region_kinds.contains(&(proto::RegionKind::Memfd as i32));
        if memfd && !self.layout.fd_channel_socket.is_empty() {
            Some(std::path::PathBuf::from(&self.layout.fd_channel_socket))
        } else {
            None
        }
    }

    fn check_detached(&self) -> Result<()> {
        if self.arena.is_some() {
            return Err(Error::new(Code::FailedPrecondition, "shared memory is already attached"));
        }
        Ok(())
    }

    /// Registers both roles of `arena` with the bodies `body` makes; on a failure the roles
    /// registered so far are unregistered again and the arena is freed.
    fn register<F>(&mut self, arena: ShmArena, mut body: F) -> Result<&mut ShmArena>
    where
        F: FnMut(&ShmArena, proto::RegionRole) -> Result<(proto::RegionKind, proto::register_region_request::Region)>,
    {
        let mut regions = Vec::new();
        for role in [proto::RegionRole::Parameters, proto::RegionRole::Gradients] {
            let r = body(&arena, role).and_then(|(kind, region)| {
                self.client.rpc().register_region(proto::RegisterRegionRequest {
                    session_id: self.id.clone(),
                    role: role as i32,
                    kind: kind as i32,
                    region: Some(region),
                    ..Default::default()
                })
            });
            match r {
                Ok(r) => regions.push(r.region_id),
                Err(e) => {
                    for id in regions {
                        let _ = self.unregister(id);
                    }
                    return Err(e);
                }
            }
        }
        self.regions = regions;
        Ok(self.arena.insert(arena))
    }

    /// Unregisters and frees the arena (the session goes back to streamed tensors).
    pub fn detach_shm(&mut self) -> Result<()> {
        let regions = std::mem::take(&mut self.regions);
        let mut first_error = None;
        for id in regions {
            if let Err(e) = self.unregister(id) {
                first_error.get_or_insert(e);
            }
        }
        self.arena = None;
        first_error.map_or(Ok(()), Err)
    }

    fn unregister(&self, region_id: String) -> Result<()> {
        self.client
            .rpc()
            .unregister_region(proto::UnregisterRegionRequest { session_id: self.id.clone(), region_id })?;
        Ok(())
    }

    pub fn arena(&self) -> Option<&ShmArena> {
        self.arena.as_ref()
    }
    pub fn arena_mut(&mut self) -> Option<&mut ShmArena> {
        self.arena.as_mut()
    }
    /// The registered region ids (parameters, gradients) while shm is attached.
    pub fn region_ids(&self) -> &[String] {
        &self.regions
    }

    // ---- steps --------------------------------------------------------------------------------

    /// Applies step `index` (steps start at 1; `index` must be the last applied + 1, or the last
    /// one, which the daemon answers from its record with `replayed` set). A transport failure
    /// or deadline is retried with the same index under the retry policy, so a step is applied
    /// exactly once even when an answer is lost.
    pub fn step(&mut self, index: i64) -> Result<proto::StepResponse> {
        self.step_with(index, &StepOptions::default())
    }

    pub fn step_with(&mut self, index: i64, opts: &StepOptions) -> Result<proto::StepResponse> {
        let req = proto::StepRequest {
            session_id: self.id.clone(),
            step_index: index,
            lr_override: opts.lr_override.clone(),
            gradient_scale: opts.gradient_scale,
            asynchronous: opts.asynchronous,
            params_without_grad: opts.params_without_grad.clone(),
            max_grad_norm: opts.max_grad_norm,
            ..Default::default()
        };
        let mut wait = self.retry.backoff;
        let mut attempt = 1;
        loop {
            match self.client.rpc().step(req.clone()) {
                Err(e) if e.is_transient() && attempt < self.retry.attempts.max(1) => {
                    std::thread::sleep(wait);
                    wait *= 2;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Waits for the step queued by an asynchronous [`Session::step_with`] and returns its
    /// answer (its error, naming the step, if it failed). `index`: 0 or the queued step's. With
    /// nothing queued, the recorded last answer (`replayed` set).
    pub fn wait_step(&mut self, index: i64) -> Result<proto::StepResponse> {
        self.client.rpc().step(proto::StepRequest {
            session_id: self.id.clone(),
            step_index: index,
            wait: true,
            ..Default::default()
        })
    }

    // ---- streamed tensors ---------------------------------------------------------------------

    /// Uploads gradients by name, fp32 (remote mode, or into the registered gradient region).
    pub fn push_gradients(&mut self, grads: &[(&str, &[f32])]) -> Result<proto::PushGradientsResponse> {
        let bytes: Vec<(&str, Vec<u8>)> = grads.iter().map(|(n, v)| (*n, f32_bytes(v))).collect();
        let refs: Vec<(&str, &[u8])> = bytes.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        self.push_gradient_bytes(&refs)
    }

    /// Uploads gradients as bytes of the trainer's dtype.
    pub fn push_gradient_bytes(&mut self, grads: &[(&str, &[u8])]) -> Result<proto::PushGradientsResponse> {
        self.client.rpc().push_gradients(chunks(&self.id, grads, self.chunk_bytes))
    }

    /// Downloads parameters (all when `names` is empty).
    pub fn pull_parameters(&self, names: &[&str]) -> Result<TensorMap> {
        let mut r = Reassembler::default();
        self.client.rpc().pull_parameters(
            proto::PullParametersRequest {
                session_id: self.id.clone(),
                names: names.iter().map(|s| s.to_string()).collect(),
                chunk_bytes: self.chunk_bytes as i64,
            },
            |c| r.add(c),
        )?;
        r.finish()
    }

    /// The optimizer state, named "<param>/state.<name>", plus the parameters themselves under
    /// their own names when `include_parameters`.
    pub fn get_state(&self, include_parameters: bool) -> Result<TensorMap> {
        let mut r = Reassembler::default();
        self.client
            .rpc()
            .get_state(proto::GetStateRequest { session_id: self.id.clone(), include_parameters }, |c| r.add(c))?;
        r.finish()
    }

    /// Sets state tensors and/or parameters (by their own names) from bytes; every tensor must
    /// be complete. Returns the number of tensors set.
    pub fn set_state(&mut self, tensors: &[(&str, &[u8])]) -> Result<i64> {
        Ok(self.client.rpc().set_state(chunks(&self.id, tensors, self.chunk_bytes))?.tensors)
    }

    /// [`Session::set_state`] from a [`TensorMap`] (e.g. one [`Session::get_state`] returned).
    pub fn set_state_map(&mut self, tensors: &TensorMap) -> Result<i64> {
        let refs: Vec<(&str, &[u8])> = tensors.iter().map(|(n, t)| (n.as_str(), t.data.as_slice())).collect();
        self.set_state(&refs)
    }

    /// Changes the set fields of `hp` for group `group`.
    pub fn set_hyperparameters(&self, group: &str, hp: &Hyperparameters) -> Result<()> {
        self.client.rpc().set_hyperparameters(proto::SetHyperparametersRequest {
            session_id: self.id.clone(),
            group: group.to_string(),
            hyperparameters: Some(hp.0.clone()),
        })?;
        Ok(())
    }

    // ---- checkpoints and lifetime -------------------------------------------------------------

    /// Saves a checkpoint under `directory` (empty = the daemon's --state_dir).
    pub fn save_checkpoint(&self, directory: &str) -> Result<proto::SaveCheckpointResponse> {
        self.client.rpc().save_checkpoint(proto::SaveCheckpointRequest {
            session_id: self.id.clone(),
            directory: directory.to_string(),
        })
    }

    /// Closes the session on the daemon and frees the arena.
    pub fn close(mut self) -> Result<()> {
        let client = self.client.clone();
        self.close_inner(&client)
    }

    fn close_inner(&mut self, client: &Client) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.regions.clear();
        let r = client.rpc().close_session(proto::CloseSessionRequest { session_id: self.id.clone() });
        self.arena = None;
        r.map(|_| ())
    }
}

/// The longest a drop waits for CloseSession (a hung daemon must not hang the trainer's exit).
const DROP_CLOSE_DEADLINE: Duration = Duration::from_secs(10);

impl Drop for Session {
    fn drop(&mut self) {
        let deadline = self.client.timeout().map_or(DROP_CLOSE_DEADLINE, |d| d.min(DROP_CLOSE_DEADLINE));
        let client = self.client.with_timeout(Some(deadline));
        let _ = self.close_inner(&client);
    }
}
