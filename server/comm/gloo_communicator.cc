#include "server/comm/gloo_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <list>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "gloo/algorithm.h"
#include "gloo/allreduce_ring_chunked.h"
#include "gloo/barrier_all_to_all.h"
#include "gloo/broadcast_one_to_all.h"
#include "gloo/common/error.h"
#include "gloo/reduce_scatter.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/address.h"
#include "gloo/transport/tcp/device.h"
#include "server/comm/gloo_store.h"

namespace diond::comm {
namespace {

// Pairwise exchange of equal blocks over persistent bound buffers: rank r sends
// in + j*send_stride to rank j and receives rank j's block at out + j*block. send_stride = block
// is an all-to-all, send_stride = 0 (one input block) an all-gather. Each receiver first sends a
// clear-to-send to every peer, and a sender writes to a peer only after its clear-to-send, so a
// fast rank can never overwrite a block the slow rank has not copied out yet (the pattern of
// gloo::BroadcastOneToAll). gloo::AllgatherRing has no such handshake: its last notification
// only says "received", so a peer that returns first and starts the next call on the same
// cached buffers writes its next block into `out` while this rank may still be copying the
// previous result out of it.
class PairwiseExchange : public gloo::Algorithm {
 public:
  PairwiseExchange(const std::shared_ptr<gloo::Context>& ctx, char* in, size_t send_stride,
                   char* out, size_t block_bytes)
      : gloo::Algorithm(ctx), in_(in), out_(out), send_stride_(send_stride), block_(block_bytes) {
    const auto data_slot = context_->nextSlot();
    const auto cts_slot = context_->nextSlot();
    peers_.resize(contextSize_);
    for (int j = 0; j < contextSize_; ++j) {
      if (j == contextRank_) continue;
      auto& pair = context_->getPair(j);
      peers_[j].send = pair->createSendBuffer(data_slot, in_ + j * send_stride_, block_);
      peers_[j].recv = pair->createRecvBuffer(data_slot, out_ + j * block_, block_);
      peers_[j].cts_send = pair->createSendBuffer(cts_slot, &dummy_, sizeof(dummy_));
      peers_[j].cts_recv = pair->createRecvBuffer(cts_slot, &peers_[j].dummy, sizeof(int));
    }
  }

  void run() override {
    std::memcpy(out_ + contextRank_ * block_, in_ + contextRank_ * send_stride_, block_);
    if (block_ == 0) return;
    for (int k = 1; k < contextSize_; ++k) peers_[Peer(k)].cts_send->send();
    for (int k = 1; k < contextSize_; ++k) {
      Entry& p = peers_[Peer(k)];
      p.cts_recv->waitRecv();
      p.send->send();
    }
    for (int k = 1; k < contextSize_; ++k) peers_[Peer(k)].recv->waitRecv();
    for (int k = 1; k < contextSize_; ++k) {
      peers_[Peer(k)].send->waitSend();
      peers_[Peer(k)].cts_send->waitSend();
    }
  }

 private:
  // Staggered order (rank+k) spreads the load instead of everybody sending to rank 0 first.
  int Peer(int k) const { return (contextRank_ + k) % contextSize_; }
  struct Entry {
    std::unique_ptr<gloo::transport::Buffer> send, recv, cts_send, cts_recv;
    int dummy = 0;
  };
  char* in_;
  char* out_;
  size_t send_stride_;
  size_t block_;
  int dummy_ = 0;
  std::vector<Entry> peers_;
};

// Bytes one rank sends in gloo::AllreduceRingChunked::run(), replaying its chunk schedule.
int64_t ChunkedRingBytes(int64_t count, int w, int rank, int64_t elem) {
  if (w <= 1 || count == 0) return 0;
  const int64_t chunks = int64_t{2} * w;
  const int64_t cs = std::max<int64_t>(256, (count + chunks - 1) / chunks);
  auto len = [&](int64_t c) -> int64_t {
    int64_t off = (c % chunks) * cs;
    if (off + cs <= count) return cs;
    if (off < count) return count - off;
    return 1;  // Gloo sends one element for an empty chunk
  };
  auto offset = [&](int64_t round) {
    return ((int64_t{2} * rank) - (round & ~int64_t{1}) + (round & 1) + chunks) % chunks;
  };
  int64_t n = len(int64_t{2} * rank) + len(int64_t{2} * rank + 1);
  for (int64_t round = 2; round < chunks; ++round) n += len(offset(round));
  for (int64_t round = 0; round < chunks - 4; ++round) n += len(offset(round));
  return n * elem;
}

bool IsPowerOfTwo(int w) { return w > 0 && (w & (w - 1)) == 0; }

}  // namespace

struct GlooCommunicator::Impl {
  GlooOptions options;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::vector<std::string> peer_address;  // by rank, "host]:port" as Gloo prints it
  absl::Mutex mu;

  // One cached algorithm and its staging buffers.
  struct Entry {
    std::vector<char> a, b;
    std::unique_ptr<gloo::Algorithm> algo;
  };
  using Key = std::tuple<int, int64_t, int64_t>;  // (kind, elements, extra)
  std::list<std::pair<Key, std::unique_ptr<Entry>>> lru ABSL_GUARDED_BY(mu);
  std::unique_ptr<gloo::BarrierAllToAll> barrier ABSL_GUARDED_BY(mu);

  template <typename Make>
  Entry* Get(const Key& key, Make make) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = lru.begin(); it != lru.end(); ++it) {
      if (it->first == key) {
        lru.splice(lru.begin(), lru, it);
        return lru.front().second.get();
      }
    }
    auto e = std::make_unique<Entry>();
    make(*e);
    lru.emplace_front(key, std::move(e));
    const size_t limit = static_cast<size_t>(options.cache_entries_per_op) * 7;
    while (lru.size() > limit) {
      try {
        lru.pop_back();
      } catch (const std::exception& ex) {  // Gloo destructors may throw (noexcept(false))
        DIOND_LOG(WARNING) << "gloo: evicting a cached algorithm: " << ex.what();
      }
    }
    return lru.front().second.get();
  }

  // Between a transfer and the copy of its result out of the cached buffers.
  void AfterTransfer(CollectiveOp op) const {
    if (options.after_transfer_for_testing) options.after_transfer_for_testing(op);
  }

  // Names the rank a Gloo error message is about: the one whose listening address it quotes
  // (when this rank dialled it), or the only peer when W = 2. A peer that dialled us shows up
  // with an ephemeral port, which names nobody: the World's coordinator names it instead.
  std::string NamePeer(const std::string& what) const {
    for (size_t j = 0; j < peer_address.size(); ++j) {
      if (!peer_address[j].empty() && what.find(peer_address[j]) != std::string::npos) {
        return absl::StrCat("rank ", j, " (", peer_address[j], ")");
      }
    }
    if (peer_address.size() == 2) return absl::StrCat("rank ", 1 - options.rank);
    return "";
  }
};

GlooCommunicator::GlooCommunicator(int rank, int size, CollectiveObserver observer)
    : Communicator(rank, size, std::move(observer)), impl_(std::make_unique<Impl>()) {}

GlooCommunicator::~GlooCommunicator() {
  try {
    absl::MutexLock lock(&impl_->mu);
    impl_->lru.clear();
    impl_->barrier.reset();
    impl_->context.reset();
  } catch (const std::exception& e) {
    DIOND_LOG(WARNING) << "gloo: tearing down the communicator: " << e.what();
  }
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    KeyValueStore* kv, const GlooOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " outside world of size ", options.size));
  }
  std::unique_ptr<GlooCommunicator> c(
      new GlooCommunicator(options.rank, options.size, options.observer));
  Impl& impl = *c->impl_;
  impl.options = options;
  GlooStore store(kv, options.prefix, options.timeout);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    impl.device = gloo::transport::tcp::CreateDevice(attr);
    impl.context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    impl.context->setTimeout(absl::ToChronoMilliseconds(options.timeout));
    impl.context->connectFullMesh(store, impl.device);
    impl.barrier = std::make_unique<gloo::BarrierAllToAll>(impl.context);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo rendezvous of rank ", options.rank, " of ",
                                               options.size, " under '", options.prefix,
                                               "' failed: ", e.what()));
  }
  // Each rank's rendezvous value is the address its TCP device listens on (this Gloo build keys
  // it by rank); knowing it lets errors ("Connection closed by peer [host]:port") name the rank.
  impl.peer_address.resize(options.size);
  for (int j = 0; j < options.size; ++j) {
    if (j == options.rank) continue;
    auto v = kv->Get(store.Key(std::to_string(j)));
    if (!v.ok() || v->size() > gloo::transport::Address::kMaxByteSize) continue;
    try {
      gloo::transport::tcp::Address a(std::vector<char>(v->begin(), v->end()));
      // Gloo prints addresses with Address::str(); match that text, not our own rendering.
      std::string text = a.str();
      impl.peer_address[j] = text.substr(0, text.find('$'));
    } catch (const std::exception&) {
      // Unknown layout: errors will not name the rank; nothing else depends on it.
    }
  }
  return c;
}

namespace {

template <typename F>
absl::Status RunGloo(const char* what, int rank, int size, F&& f,
                     const std::function<std::string(const std::string&)>& name_peer) {
  try {
    f();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    std::string peer = name_peer(e.what());
    return absl::UnavailableError(absl::StrCat(what, " failed on rank ", rank, " of ", size,
                                               peer.empty()
                                                   ? std::string(": a peer was lost or timed out")
                                                   : absl::StrCat(": lost ", peer),
                                               " (gloo: ", e.what(), ")"));
  }
}

}  // namespace

#define DIOND_GLOO_OP(op_enum, bytes_expr, ...)                                                 \
  do {                                                                                          \
    DIOND_RETURN_IF_ERROR(status());                                                            \
    absl::MutexLock lock(&impl_->mu);                                                           \
    const absl::Time t0 = absl::Now();                                                          \
    const int64_t bytes_ = (bytes_expr);                                                        \
    [[maybe_unused]] const CollectiveOp op_ = (op_enum);                                        \
    absl::Status s_ = RunGloo(                                                                  \
        std::string(CollectiveOpName(op_enum)).c_str(), rank(), size(), [&]() { __VA_ARGS__; }, \
        [this](const std::string& w) { return impl_->NamePeer(w); });                           \
    if (!s_.ok()) Abort(s_);                                                                    \
    Record(op_enum, s_.ok() ? bytes_ : 0, absl::ToDoubleSeconds(absl::Now() - t0), s_);         \
    return s_;                                                                                  \
  } while (false)

namespace {
absl::Status CheckInt(int64_t elements, int64_t elem_bytes, const char* what) {
  if (elements * elem_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", elements * elem_bytes,
                                                   " bytes in one call; Gloo's limit is ", INT_MAX,
                                                   " (split the buffer)"));
  }
  return absl::OkStatus();
}
enum Kind { kAR = 1, kRS, kRSPair, kAG, kAGBytes, kA2A, kBcast, kBcastBytes };
}  // namespace

absl::Status GlooCommunicator::AllReduceSum(absl::Span<float> data) {
  const int64_t n = static_cast<int64_t>(data.size());
  DIOND_RETURN_IF_ERROR(CheckInt(n, 4, "all_reduce"));
  DIOND_GLOO_OP(CollectiveOp::kAllReduce, ChunkedRingBytes(n, size(), rank(), 4), {
    if (n == 0 || size() == 1) return;
    auto* e = impl_->Get({kAR, n, 0}, [&](Impl::Entry& e) {
      e.a.resize(n * 4);
      e.algo = std::make_unique<gloo::AllreduceRingChunked<float>>(
          impl_->context, std::vector<float*>{reinterpret_cast<float*>(e.a.data())},
          static_cast<int>(n));
    });
    std::memcpy(e->a.data(), data.data(), n * 4);
    e->algo->run();
    impl_->AfterTransfer(op_);
    std::memcpy(data.data(), e->a.data(), n * 4);
  });
}

absl::Status GlooCommunicator::AllReduceAverage(absl::Span<float> data) {
  DIOND_RETURN_IF_ERROR(AllReduceSum(data));
  const float inv = 1.0f / static_cast<float>(size());
  for (float& v : data) v *= inv;
  return absl::OkStatus();
}

absl::Status GlooCommunicator::ReduceScatterSum(absl::Span<const float> input,
                                                absl::Span<float> output) {
  const int64_t block = static_cast<int64_t>(output.size());
  const int w = size();
  if (static_cast<int64_t>(input.size()) != block * w) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: input has ", input.size(),
                                                   " elements, expected ", w, " x ", block));
  }
  DIOND_RETURN_IF_ERROR(CheckInt(block * w, 4, "reduce_scatter"));
  DIOND_GLOO_OP(CollectiveOp::kReduceScatter, RingAllGatherBytes(block * w * 4, w), {
    if (block == 0) return;
    if (w == 1) {
      std::memcpy(output.data(), input.data(), block * 4);
      return;
    }
    if (IsPowerOfTwo(w)) {
      auto* e = impl_->Get({kRS, block, 0}, [&](Impl::Entry& e) {
        e.a.resize(block * w * 4);
        e.algo = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
            impl_->context, std::vector<float*>{reinterpret_cast<float*>(e.a.data())},
            static_cast<int>(block * w), std::vector<int>(w, static_cast<int>(block)));
      });
      std::memcpy(e->a.data(), input.data(), block * w * 4);
      e->algo->run();
      impl_->AfterTransfer(op_);
      // Rank r's result lands at the START of the buffer (TOOLCHAIN.md P13).
      std::memcpy(output.data(), e->a.data(), block * 4);
      return;
    }
    auto* e = impl_->Get({kRSPair, block, 0}, [&](Impl::Entry& e) {
      e.a.resize(block * w * 4);
      e.b.resize(block * w * 4);
      e.algo = std::make_unique<PairwiseExchange>(impl_->context, e.a.data(),
                                                  static_cast<size_t>(block) * 4, e.b.data(),
                                                  static_cast<size_t>(block) * 4);
    });
    std::memcpy(e->a.data(), input.data(), block * w * 4);
    e->algo->run();
    impl_->AfterTransfer(op_);
    const float* in = reinterpret_cast<const float*>(e->b.data());
    for (int64_t i = 0; i < block; ++i) output[i] = in[i];
    for (int j = 1; j < w; ++j) {
      const float* blk = in + j * block;
      for (int64_t i = 0; i < block; ++i) output[i] += blk[i];
    }
  });
}

absl::Status GlooCommunicator::AllGather(absl::Span<const float> input, absl::Span<float> output) {
  return AllGatherBytes(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(input.data()), input.size() * 4),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(output.data()), output.size() * 4));
}

absl::Status GlooCommunicator::AllGatherBytes(absl::Span<const uint8_t> input,
                                              absl::Span<uint8_t> output) {
  const int64_t n = static_cast<int64_t>(input.size());
  const int w = size();
  if (static_cast<int64_t>(output.size()) != n * w) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.size(),
                                                   " elements, expected ", w, " x ", n));
  }
  DIOND_RETURN_IF_ERROR(CheckInt(n * w, 1, "all_gather"));
  DIOND_GLOO_OP(CollectiveOp::kAllGather, (w - 1) * n, {
    if (n == 0) return;
    if (w == 1) {
      std::memcpy(output.data(), input.data(), n);
      return;
    }
    auto* e = impl_->Get({kAGBytes, n, 0}, [&](Impl::Entry& e) {
      e.a.resize(n);
      e.b.resize(n * w);
      e.algo = std::make_unique<PairwiseExchange>(impl_->context, e.a.data(), 0, e.b.data(),
                                                  static_cast<size_t>(n));
    });
    std::memcpy(e->a.data(), input.data(), n);
    e->algo->run();
    impl_->AfterTransfer(op_);
    std::memcpy(output.data(), e->b.data(), n * w);
  });
}

absl::Status GlooCommunicator::AllGatherV(absl::Span<const float> input,
                                          absl::Span<const int64_t> counts,
                                          absl::Span<float> output) {
  const int w = size();
  int64_t largest = 0;
  DIOND_RETURN_IF_ERROR(CheckAllGatherV(input, counts, output, &largest));
  DIOND_RETURN_IF_ERROR(CheckInt(largest * w, 4, "all_gather_v"));
  // Padded to the largest block: a pairwise exchange on persistent buffers beats Gloo's
  // allgatherv options API by far here (P10); the padding is sent and counted.
  DIOND_GLOO_OP(CollectiveOp::kAllGatherV, (w - 1) * largest * 4, {
    if (largest == 0) return;
    if (w == 1) {
      std::memcpy(output.data(), input.data(), input.size() * 4);
      return;
    }
    auto* e = impl_->Get({kAG, largest, 0}, [&](Impl::Entry& e) {
      e.a.resize(largest * 4);
      e.b.resize(largest * w * 4);
      e.algo = std::make_unique<PairwiseExchange>(impl_->context, e.a.data(), 0, e.b.data(),
                                                  static_cast<size_t>(largest) * 4);
    });
    std::memcpy(e->a.data(), input.data(), input.size() * 4);
    e->algo->run();
    impl_->AfterTransfer(op_);
    const float* all = reinterpret_cast<const float*>(e->b.data());
    int64_t at = 0;
    for (int j = 0; j < w; ++j) {
      std::memcpy(output.data() + at, all + j * largest, counts[j] * 4);
      at += counts[j];
    }
  });
}

absl::Status GlooCommunicator::AllToAll(absl::Span<const float> input, absl::Span<float> output) {
  const int w = size();
  if (input.size() != output.size() || input.size() % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("all_to_all: input has ", input.size(),
                                                   " elements, output ", output.size(),
                                                   "; both must be equal and divisible by ", w));
  }
  const int64_t block = static_cast<int64_t>(input.size()) / w;
  DIOND_RETURN_IF_ERROR(CheckInt(block * w, 4, "all_to_all"));
  DIOND_GLOO_OP(CollectiveOp::kAllToAll, (w - 1) * block * 4, {
    if (block == 0) return;
    if (w == 1) {
      std::memcpy(output.data(), input.data(), block * 4);
      return;
    }
    auto* e = impl_->Get({kA2A, block, 0}, [&](Impl::Entry& e) {
      e.a.resize(block * w * 4);
      e.b.resize(block * w * 4);
      e.algo = std::make_unique<PairwiseExchange>(impl_->context, e.a.data(),
                                                  static_cast<size_t>(block) * 4, e.b.data(),
                                                  static_cast<size_t>(block) * 4);
    });
    std::memcpy(e->a.data(), input.data(), block * w * 4);
    e->algo->run();
    impl_->AfterTransfer(op_);
    std::memcpy(output.data(), e->b.data(), block * w * 4);
  });
}

absl::Status GlooCommunicator::Broadcast(absl::Span<float> data, int root) {
  return BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(data.data()), data.size() * 4),
                        root);
}

absl::Status GlooCommunicator::BroadcastBytes(absl::Span<uint8_t> data, int root) {
  const int w = size();
  if (root < 0 || root >= w) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " outside [0, ", w, ")"));
  }
  const int64_t n = static_cast<int64_t>(data.size());
  DIOND_RETURN_IF_ERROR(CheckInt(n, 1, "broadcast"));
  DIOND_GLOO_OP(CollectiveOp::kBroadcast, rank() == root ? (w - 1) * n : 0, {
    if (n == 0 || w == 1) return;
    auto* e = impl_->Get({kBcastBytes, n, root}, [&](Impl::Entry& e) {
      e.a.resize(n);
      e.algo = std::make_unique<gloo::BroadcastOneToAll<char>>(
          impl_->context, std::vector<char*>{e.a.data()}, static_cast<size_t>(n), root);
    });
    if (rank() == root) std::memcpy(e->a.data(), data.data(), n);
    e->algo->run();
    impl_->AfterTransfer(op_);
    if (rank() != root) std::memcpy(data.data(), e->a.data(), n);
  });
}

absl::Status GlooCommunicator::Barrier() {
  DIOND_GLOO_OP(CollectiveOp::kBarrier, 0, {
    if (size() > 1) impl_->barrier->run();
  });
}

}  // namespace diond::comm
