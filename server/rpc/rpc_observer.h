// What the RPC layer reports about its calls, as an interface: the composition root
// (server/exe) connects it to the daemon's metrics, so that server/rpc needs nothing of them.
#ifndef DIOND_SERVER_RPC_RPC_OBSERVER_H_
#define DIOND_SERVER_RPC_RPC_OBSERVER_H_

#include <string>

#include "absl/strings/string_view.h"

namespace diond::rpc {

class RpcObserver {
 public:
  virtual ~RpcObserver() = default;
  // One finished call: its full method name ("/diond.v1.Optimizer/Step"), its status code's name
  // ("OK", "INVALID_ARGUMENT", ...) and its latency. Called from gRPC's threads.
  virtual void ObserveRpc(absl::string_view method, absl::string_view code, double seconds) = 0;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_RPC_OBSERVER_H_
