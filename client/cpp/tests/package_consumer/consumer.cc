// Uses the installed diondClient package: the public headers, the generated proto types and
// code from the library (layout validation, status mapping, an unregistered shm arena, a
// connection attempt to a daemon that is not there).
#include <cstdio>

#include "diond/client.h"
#include "diond/shm_arena.h"
#include "diond/v1/optimizer.pb.h"

int main() {
  diond::v1::CreateSessionResponse resp;
  resp.set_session_id("s");
  resp.set_param_arena_bytes(256);
  resp.set_grad_arena_bytes(256);
  resp.set_alignment_bytes(256);
  diond::v1::TensorLayout* t = resp.add_layout();
  t->set_name("w");
  t->add_shape(4);
  t->add_shape(4);
  t->set_dtype(diond::v1::DTYPE_F32);
  t->set_size_bytes(64);
  auto layout = diond::client::LayoutFromProto(resp);
  if (!layout.ok()) return std::fprintf(stderr, "%s\n", layout.status().ToString().c_str()), 1;
  auto arena = diond::client::ShmArena::CreateUnregistered(*layout);
  if (!arena.ok()) return std::fprintf(stderr, "%s\n", arena.status().ToString().c_str()), 1;
  auto w = arena->Param("w");
  if (!w.ok() || w->size() != 16) return 1;
  diond::client::ClientOptions o;
  o.connect_timeout = absl::Milliseconds(100);
  auto client = diond::client::Client::Connect("unix:/nonexistent/diond.sock", o);
  if (client.status().code() != absl::StatusCode::kUnavailable) return 1;
  std::printf("consumer OK: arena segment %s, connect: %s\n", arena->segments()[0].name.c_str(),
              client.status().ToString().c_str());
  return 0;
}
