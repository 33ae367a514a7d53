#include "server/rpc/optimizer_service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/memory/gpu_uuid.h"
#include "server/rpc/access.h"
#include "server/rpc/convert.h"
#include "server/rpc/status_conversion.h"

namespace diond::rpc {

grpc::ServerUnaryReactor* OptimizerService::Offload(grpc::CallbackServerContext* ctx,
                                                    std::function<absl::Status()> work) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  pool_->Run([r, work = std::move(work)] { r->Finish(ToGrpcStatus(work())); });
  return r;
}

std::function<absl::Status(const std::string&)> OptimizerService::OwnerCheck(
    grpc::CallbackServerContext* ctx) const {
  absl::StatusOr<Principal> p = auth_->Authenticate(*ctx);
  session::SessionManager* manager = manager_;
  return [p, manager](const std::string& id) -> absl::Status {
    if (!p.ok()) return p.status();
    return OwnedSession(manager, *p, id).status();
  };
}

grpc::ServerUnaryReactor* OptimizerService::CreateSession(grpc::CallbackServerContext* ctx,
                                                          const v1::CreateSessionRequest* req,
                                                          v1::CreateSessionResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    auto spec = SpecFromProto(*req);
    if (!spec.ok()) return spec.status();
    spec->owner = p->name;
    auto s = manager_->CreateSession(*std::move(spec), p->process);
    if (!s.ok()) return s.status();
    LayoutToProto(**s, resp);
    DataPlaneToProto(**s, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                           const v1::RegisterRegionRequest* req,
                                                           v1::RegisterRegionResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    auto s = OwnedSession(manager_, *p, req->session_id());
    if (!s.ok()) return s.status();
    if (req->role() == v1::REGION_ROLE_DOORBELLS) {
      auto id = RegisterDoorbells(*p, s->get(), *req, ctx->peer());
      if (!id.ok()) return id.status();
      resp->set_region_id(*id);
      return absl::OkStatus();
    }
    auto role_or = RegionRoleFromProto(*req);
    if (!role_or.ok()) return role_or.status();
    const session::Role role = *role_or;
    switch (req->kind()) {
      case v1::REGION_KIND_MEMFD: {
        auto id = RegisterMemfd(*p, s->get(), role, req->memfd());
        if (!id.ok()) return id.status();
        resp->set_region_id(*id);
        return absl::OkStatus();
      }
      case v1::REGION_KIND_CUDA_IPC:
      case v1::REGION_KIND_CUDA_VMM_FD: {
        auto id = RegisterCuda(*p, s->get(), role, *req);
        if (!id.ok()) return id.status();
        resp->set_region_id(*id);
        return absl::OkStatus();
      }
      default:
        break;  // REGION_KIND_SYSTEM_SHM, below
    }
    const v1::SystemShmRegion& shm = req->system_shm();
    if (absl::Status o = CheckShmCaller(*p, shm.name(), ctx->peer()); !o.ok()) return o;
    auto id = (*s)->RegisterShmRegion(role, shm.name(), shm.offset_bytes(), shm.size_bytes());
    if (!id.ok()) return id.status();
    resp->set_region_id(*id);
    return absl::OkStatus();
  });
}

absl::Status OptimizerService::CheckShmCaller(const Principal& p, const std::string& name,
                                              const std::string& peer) const {
  if (!options_.allow_shm_from_tcp && !p.local) {
    return absl::PermissionDeniedError(
        absl::StrCat("shared-memory registration from ", peer,
                     " is off: connect over the Unix socket, or start diond with "
                     "--allow_shm_from_tcp"));
  }
  return CheckSegmentOwner(p, name);
}

absl::StatusOr<std::string> OptimizerService::RegisterDoorbells(
    const Principal& p, session::Session* s, const v1::RegisterRegionRequest& req,
    const std::string& peer) {
  DIOND_ASSIGN_OR_RETURN(std::vector<session::DoorbellBucket> buckets,
                         DoorbellBucketsFromProto(req));
  if (req.kind() == v1::REGION_KIND_MEMFD) {
    DIOND_ASSIGN_OR_RETURN(fdchannel::UniqueFd fd, TakeMemfd(p, req.memfd()));
    return s->RegisterMemfdDoorbells(std::move(fd), req.memfd().offset_bytes(),
                                     req.memfd().size_bytes(), buckets);
  }
  const v1::SystemShmRegion& shm = req.system_shm();
  DIOND_RETURN_IF_ERROR(CheckShmCaller(p, shm.name(), peer));
  return s->RegisterShmDoorbells(shm.name(), shm.offset_bytes(), shm.size_bytes(), buckets);
}

absl::StatusOr<std::string> OptimizerService::RegisterMemfd(const Principal& p, session::Session* s,
                                                            session::Role role,
                                                            const v1::MemfdRegion& m) {
  DIOND_ASSIGN_OR_RETURN(fdchannel::UniqueFd fd, TakeMemfd(p, m));
  return s->RegisterMemfdRegion(role, std::move(fd), m.offset_bytes(), m.size_bytes());
}

absl::StatusOr<fdchannel::UniqueFd> OptimizerService::TakeMemfd(const Principal& p,
                                                                const v1::MemfdRegion& m) {
  if (options_.fd_channel == nullptr) {
    return absl::FailedPreconditionError(
        "REGION_KIND_MEMFD needs the daemon's fd channel, and this daemon has none (it listens "
        "on no Unix socket, or runs with --fd_channel_socket=none); use REGION_KIND_SYSTEM_SHM");
  }
  if (!p.local) {
    return absl::PermissionDeniedError(
        "REGION_KIND_MEMFD is for callers on the daemon's Unix socket: the fd channel's token is "
        "checked against the caller's uid");
  }
  return options_.fd_channel->Take(m.fd_token(), p.uid, fdchannel::FdKind::kMemfd);
}

absl::StatusOr<std::string> OptimizerService::RegisterCuda(const Principal& p, session::Session* s,
                                                           session::Role role,
                                                           const v1::RegisterRegionRequest& req) {
  const bool ipc = req.kind() == v1::REGION_KIND_CUDA_IPC;
  const std::string kind = v1::RegionKind_Name(req.kind());
  std::string uuid_bytes;
  fdchannel::UniqueFd vmm_fd;
  if (ipc) {
    if (!req.has_cuda_ipc()) return absl::InvalidArgumentError(kind + " needs cuda_ipc");
    const v1::CudaIpcRegion& r = req.cuda_ipc();
    if (r.mem_handle().size() != 64) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.mem_handle must be the 64 bytes of a cudaIpcMemHandle_t; got ",
                       r.mem_handle().size(), " bytes"));
    }
    if (r.offset_bytes() < 0 || r.offset_bytes() % 256 != 0 || r.size_bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: offset_bytes ", r.offset_bytes(),
                                                     " must be a non-negative multiple of 256 "
                                                     "and size_bytes ",
                                                     r.size_bytes(), " positive"));
    }
    uuid_bytes = r.gpu_uuid();
  } else {
    if (!req.has_cuda_vmm_fd()) return absl::InvalidArgumentError(kind + " needs cuda_vmm_fd");
    const v1::CudaVmmFdRegion& r = req.cuda_vmm_fd();
    // The fd, if one was sent, is taken first (and closed when the request fails, whatever
    // follows): a refused request must not leave it pending.
    if (options_.fd_channel != nullptr && p.local && !r.fd_token().empty()) {
      DIOND_ASSIGN_OR_RETURN(
          vmm_fd, options_.fd_channel->Take(r.fd_token(), p.uid, fdchannel::FdKind::kCudaVmm));
    }
    const int64_t g = r.granularity_bytes();
    if (g <= 0 || (g & (g - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_vmm_fd.granularity_bytes ", g, " must be a positive power of two"));
    }
    if (r.offset_bytes() < 0 || r.offset_bytes() % 256 != 0 || r.size_bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_vmm_fd: offset_bytes ", r.offset_bytes(),
                                                     " must be a non-negative multiple of "
                                                     "256 and size_bytes ",
                                                     r.size_bytes(), " positive"));
    }
    uuid_bytes = r.gpu_uuid();
  }
  DIOND_ASSIGN_OR_RETURN(
      memory::GpuUuid uuid,
      memory::ParseGpuUuid(uuid_bytes, ipc ? "cuda_ipc.gpu_uuid" : "cuda_vmm_fd.gpu_uuid"));
  if (!options_.gpu_daemon) {
    return absl::FailedPreconditionError(absl::StrCat(
        kind,
        " needs a daemon that computes on a GPU; this daemon runs on the CPU (start it "
        "with --device=cuda on the trainer's GPU ",
        memory::FormatGpuUuid(uuid),
        "), or register host memory: REGION_KIND_MEMFD or REGION_KIND_SYSTEM_SHM"));
  }
  // GPU memory is shared between processes of one host, as shared memory is: the same rule.
  if (!options_.allow_shm_from_tcp && !p.local) {
    return absl::PermissionDeniedError(absl::StrCat(
        kind,
        " registration over TCP is off: connect over the Unix socket (the trainer and the "
        "daemon share one host), or start diond with --allow_shm_from_tcp"));
  }
  if (ipc) {
    const v1::CudaIpcRegion& r = req.cuda_ipc();
    const auto* h = reinterpret_cast<const uint8_t*>(r.mem_handle().data());
    const absl::Span<const uint8_t> handle(h, r.mem_handle().size());
    return s->OpenCudaRegion(role, [&](kernels::Device device) {
      return memory::CudaRegion::OpenIpc(device, uuid, handle, r.offset_bytes(), r.size_bytes());
    });
  }
  const v1::CudaVmmFdRegion& r = req.cuda_vmm_fd();
  if (options_.fd_channel == nullptr) {
    return absl::FailedPreconditionError(
        "REGION_KIND_CUDA_VMM_FD needs the daemon's fd channel, and this daemon has none (it "
        "listens on no Unix socket, or runs with --fd_channel_socket=none); use "
        "REGION_KIND_CUDA_IPC");
  }
  if (!p.local) {
    return absl::PermissionDeniedError(
        "REGION_KIND_CUDA_VMM_FD is for callers on the daemon's Unix socket: the fd channel's "
        "token is checked against the caller's uid");
  }
  if (!vmm_fd.valid()) {
    return absl::InvalidArgumentError(
        "cuda_vmm_fd.fd_token is empty: send the exported fd over the fd channel first and pass "
        "the token it answered");
  }
  // The daemon's mapping keeps the allocation alive; the fd is closed when this returns.
  return s->OpenCudaRegion(role, [&](kernels::Device device) {
    return memory::CudaRegion::OpenVmm(device, uuid, vmm_fd.get(), r.offset_bytes(), r.size_bytes(),
                                       r.granularity_bytes());
  });
}

void OptimizerService::DataPlaneToProto(const session::Session& s,
                                        v1::CreateSessionResponse* resp) const {
  resp->add_region_kinds(v1::REGION_KIND_SYSTEM_SHM);
  if (options_.fd_channel != nullptr) {
    resp->set_fd_channel_socket(options_.fd_channel->path());
    resp->add_region_kinds(v1::REGION_KIND_MEMFD);
  }
  // The CUDA kinds: a device session of a GPU daemon, local or of a world (its world phases
  // run on device buffers, docs/GPU.md "World sessions").
  if (options_.gpu_daemon && s.is_device_session()) {
    resp->add_region_kinds(v1::REGION_KIND_CUDA_IPC);
    if (options_.fd_channel != nullptr) resp->add_region_kinds(v1::REGION_KIND_CUDA_VMM_FD);
  }
}

grpc::ServerUnaryReactor* OptimizerService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                             const v1::UnregisterRegionRequest* req,
                                                             v1::UnregisterRegionResponse*) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    auto s = OwnedSession(manager_, *p, req->session_id());
    if (!s.ok()) return s.status();
    return (*s)->UnregisterRegion(req->region_id());
  });
}

grpc::ServerUnaryReactor* OptimizerService::Step(grpc::CallbackServerContext* ctx,
                                                 const v1::StepRequest* req,
                                                 v1::StepResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    if (auto o = OwnedSession(manager_, *p, req->session_id()); !o.ok()) {
      return o.status();
    }
    auto r = manager_->Step(req->session_id(), StepRequestFromProto(*req));
    if (!r.ok()) return r.status();
    auto fill = [](const session::StepResult& from, v1::StepResponse* to) {
      to->set_step_index(from.step_index);
      to->set_skipped(from.skipped);
      to->set_replayed(from.replayed);
      for (const auto& [g, n] : from.update_norms) (*to->mutable_update_norms())[g] = n;
      to->set_compute_micros(from.compute_micros);
      to->set_total_micros(from.total_micros);
      to->set_world_bytes_sent(from.world_bytes_sent);
      to->set_queued(from.queued);
      to->set_grad_norm(from.grad_norm);
    };
    fill(*r, resp);
    if (!r->previous.empty()) fill(r->previous.front(), resp->mutable_previous());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::SetHyperparameters(
    grpc::CallbackServerContext* ctx, const v1::SetHyperparametersRequest* req,
    v1::SetHyperparametersResponse*) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    auto s = OwnedSession(manager_, *p, req->session_id());
    if (!s.ok()) return s.status();
    auto change = HyperparameterChangeFromProto(*req);
    if (!change.ok()) return change.status();
    return (*s)->SetGroupHyperparameters(change->group, change->lr, change->weight_decay);
  });
}

grpc::ServerUnaryReactor* OptimizerService::SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                                           const v1::SaveCheckpointRequest* req,
                                                           v1::SaveCheckpointResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    if (auto o = OwnedSession(manager_, *p, req->session_id()); !o.ok()) {
      return o.status();
    }
    if (absl::Status a = CheckPathAllowed(*p, req->directory(), "directory"); !a.ok()) {
      return a;
    }
    auto saved = manager_->SaveCheckpoint(req->session_id(), req->directory());
    if (!saved.ok()) return saved.status();
    resp->set_path(saved->first);
    resp->set_bytes(saved->second);
    auto s = manager_->Get(req->session_id());
    if (s.ok()) resp->set_step_index((*s)->last_step_index());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                                           const v1::LoadCheckpointRequest* req,
                                                           v1::LoadCheckpointResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    if (req->path().empty()) {
      return absl::InvalidArgumentError("LoadCheckpoint needs a path");
    }
    if (absl::Status a = CheckPathAllowed(*p, req->path(), "path"); !a.ok()) {
      return a;
    }
    if (req->shard_paths_size() > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat(req->shard_paths_size(), " shard_paths: at most 1024"));
    }
    std::vector<std::string> shards;
    for (const std::string& path : req->shard_paths()) {
      if (absl::Status st = CheckPathAllowed(*p, path, "shard_paths"); !st.ok()) {
        return st;
      }
      shards.push_back(path);
    }
    // The restored session keeps the owner its checkpoint records; a non-admin may load only
    // its own (SessionManager::LoadCheckpoint).
    auto s = manager_->LoadCheckpoint(req->path(), shards,
                                      session::Caller{p->name, p->admin, p->process});
    if (!s.ok()) return s.status();
    LayoutToProto(**s, resp->mutable_session());
    DataPlaneToProto(**s, resp->mutable_session());
    resp->set_step_index((*s)->last_step_index());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::AttachSession(grpc::CallbackServerContext* ctx,
                                                          const v1::AttachSessionRequest* req,
                                                          v1::AttachSessionResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    // The session manager compares the principal with the session's owner (admins may attach to
    // any session).
    std::vector<session::ParamSpec> expect;
    if (req->parameters_size() > 0) {
      v1::CreateSessionRequest declared;
      *declared.mutable_parameters() = req->parameters();
      auto spec = SpecFromProto(declared);
      if (!spec.ok()) return spec.status();
      expect = std::move(spec->params);
    }
    auto s = manager_->Attach(req->session_name(), p->name, expect, p->admin, p->process);
    if (!s.ok()) return s.status();
    LayoutToProto(**s, resp->mutable_session());
    DataPlaneToProto(**s, resp->mutable_session());
    resp->set_step_index((*s)->last_step_index());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::CloseSession(grpc::CallbackServerContext* ctx,
                                                         const v1::CloseSessionRequest* req,
                                                         v1::CloseSessionResponse*) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    if (auto o = OwnedSession(manager_, *p, req->session_id()); !o.ok()) {
      return o.status();
    }
    return manager_->Close(req->session_id());
  });
}

grpc::ServerUnaryReactor* OptimizerService::ListSessions(grpc::CallbackServerContext* ctx,
                                                         const v1::ListSessionsRequest*,
                                                         v1::ListSessionsResponse* resp) {
  return Offload(ctx, [=]() -> absl::Status {
    auto p = auth_->Authenticate(*ctx);
    if (!p.ok()) return p.status();
    const absl::Time now = absl::Now();
    for (const session::SessionInfo& info : manager_->List()) {
      if (!MayUseSession(*p, info.owner)) continue;  // only one's own sessions
      SessionInfoToProto(info, now, resp->add_sessions());
    }
    return absl::OkStatus();
  });
}

}  // namespace diond::rpc
