// SessionManager's reapers (docs/OPERATIONS.md): the trainer processes it watches, and the
// sessions it closes for them, idle (--idle_timeout) or orphaned (their trainers gone); and what
// the daemon's stop ends: overlapped steps' waits, queued steps.
#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "server/session/session_manager.h"

namespace diond::session {

void SessionManager::NoteProcess(const std::string& id, const ProcessId& process) {
  TrackProcess(id, process, /*binds=*/false);
}

void SessionManager::TrackProcess(const std::string& id, const ProcessId& process, bool binds) {
  auto watched = [&process](const Trainers& t) {
    for (const auto& w : t.live) {
      if (w->id() == process) return true;
    }
    return false;
  };
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.count(id) == 0) return;
    auto it = trainers_.find(id);
    if (!process.known()) {
      // Nobody can tell when an unknown creator or attacher (TCP, another pid namespace) is
      // gone: such a session is never an orphan. An unknown caller of other RPCs changes nothing.
      if (binds) trainers_[id].untracked = true;
      return;
    }
    if (it != trainers_.end() && (it->second.untracked || watched(it->second) ||
                                  it->second.live.size() >= kMaxWatchedProcesses)) {
      return;  // the common case of every Step: nothing to do
    }
  }
  // Outside the lock: pidfd_open and a read of /proc.
  auto watch = std::make_shared<ProcessWatch>(process);
  const bool exited = watch->Exited();
  absl::MutexLock lock(&mu_);
  if (sessions_.count(id) == 0) return;
  Trainers& t = trainers_[id];
  if (t.untracked || watched(t) || t.live.size() >= kMaxWatchedProcesses) return;
  if (exited) {  // gone already (it called, then died): the session has had a process
    t.exited.push_back(process.pid);
    return;
  }
  t.live.push_back(std::move(watch));
  t.orphan_since = absl::InfinitePast();
  t.noted = false;
}

bool SessionManager::CloseReaped(const std::string& id, const std::string& reason,
                                 const std::string& why, bool for_good) {
  ScopedLogContext log_context(id);
  // A session that never held weights cannot be checkpointed, and has nothing to lose (it never
  // stepped): it is closed without one rather than kept for good.
  bool weights = true;
  if (auto s = Get(id); s.ok()) {
    // Its trainer is gone or idle: an overlapped step waiting for a bucket would hold the
    // checkpoint (and this thread) until --overlap_bucket_timeout. Cancelled first (nothing
    // committed); any queued step's outcome goes, as Close would drop it.
    (*s)->DrainQueuedStep();
    weights = (*s)->HoldsParameters();
  }
  if (!options_.state_dir.empty() && weights) {
    auto saved = SaveCheckpoint(id, "");
    if (!saved.ok()) {
      DIOND_LOG(ERROR) << "session " << id << ": checkpoint before " << reason
                       << " close failed: " << saved.status() << "; keeping the session";
      return false;
    }
  }
  DIOND_LOG(INFO) << why
                  << (!options_.state_dir.empty() && !weights
                          ? " (no checkpoint: it never held parameters)"
                          : "");
  // Its client may have closed it meanwhile.
  if (Close(id, /*by_client=*/for_good).ok() && observer_.on_session_reaped) {
    observer_.on_session_reaped(id, reason);
  }
  return true;
}

void SessionManager::ReapIdleSessions(absl::Time now) {
  if (options_.idle_timeout <= absl::ZeroDuration()) return;
  std::vector<std::string> idle;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : sessions_) {
      if (now - s->last_used() > options_.idle_timeout) idle.push_back(id);
    }
  }
  for (const std::string& id : idle) {
    CloseReaped(id, "idle",
                absl::StrCat("session ", id, " idle for more than ",
                             absl::FormatDuration(options_.idle_timeout), "; closing it"),
                /*for_good=*/false);
  }
}

void SessionManager::ReapOrphanSessions(absl::Time now) {
  // 1. Under the lock: the sessions that have had processes, with their watches.
  // The session only weakly: a session closed meanwhile must be freed by its Close (its memory
  // back when CloseSession answers), not later on this thread.
  struct Look {
    std::string id;
    std::weak_ptr<Session> session;
    std::string name;  // SessionSpec::session_name
    bool world = false;
    std::vector<std::shared_ptr<ProcessWatch>> watches;
    std::vector<bool> exited;
    bool all_exited = true;
    absl::Time last_used;
  };
  std::vector<Look> looks;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, t] : trainers_) {
      if (t.untracked || (t.live.empty() && t.exited.empty())) continue;
      auto s = sessions_.find(id);
      if (s == sessions_.end()) continue;
      looks.push_back(Look{id,
                           s->second,
                           s->second->spec().session_name,
                           s->second->is_world_session(),
                           t.live,
                           {},
                           true,
                           absl::InfinitePast()});
    }
  }
  // 2. Outside it: are they alive, and (for orphans) when were they last used? A Step holds
  // its session's lock, which last_used() takes.
  for (Look& l : looks) {
    for (const auto& w : l.watches) {
      l.exited.push_back(w->Exited());
      l.all_exited = l.all_exited && l.exited.back();
    }
    if (!l.all_exited) continue;
    if (std::shared_ptr<Session> session = l.session.lock()) l.last_used = session->last_used();
  }
  // 3. Under the lock again: drop the exited watches, and decide.
  struct Due {
    std::string id, why;
  };
  std::vector<Due> due;
  std::vector<std::pair<std::string, std::string>> lines;  // (session, message), logged after
  // Orphans found now: nobody is left to ring their doorbells, so an overlapped step waiting for
  // one is given up at once (nothing committed; in a world the other ranks fail the step alike
  // rather than meet --peer_timeout), not at --overlap_bucket_timeout.
  std::vector<std::pair<std::string, std::weak_ptr<Session>>> cancel;
  {
    absl::MutexLock lock(&mu_);
    for (Look& l : looks) {
      auto it = trainers_.find(l.id);
      if (it == trainers_.end() || sessions_.count(l.id) == 0) continue;
      Trainers& t = it->second;
      for (size_t i = 0; i < l.watches.size(); ++i) {
        if (!l.exited[i]) continue;
        auto w = std::find(t.live.begin(), t.live.end(), l.watches[i]);
        if (w == t.live.end()) continue;
        t.exited.push_back((*w)->id().pid);
        t.live.erase(w);
      }
      constexpr size_t kPidsLogged = 8;
      if (t.exited.size() > kPidsLogged) {
        t.exited.erase(t.exited.begin(), t.exited.end() - kPidsLogged);
      }
      if (!t.live.empty()) {  // alive, or a new process came meanwhile
        t.orphan_since = absl::InfinitePast();
        t.noted = false;
        continue;
      }
      if (!l.all_exited) continue;  // emptied by a concurrent look: the next one decides
      const std::string& name = l.name;
      const std::string who = absl::StrCat(
          "session ", l.id, name.empty() ? std::string() : absl::StrCat(" ('", name, "')"),
          ": every process that created or used it has exited (pid ", absl::StrJoin(t.exited, ", "),
          ")");
      const bool first = t.orphan_since == absl::InfinitePast();
      if (first) {
        t.orphan_since = now;
        cancel.emplace_back(l.id, l.session);
      }
      absl::Duration grace = name.empty() ? options_.orphan_grace : options_.orphan_grace_named;
      const char* flag = name.empty() ? "--orphan_grace" : "--orphan_grace_named";
      if (l.world || grace <= absl::ZeroDuration()) {
        if (!t.noted) {
          t.noted = true;
          lines.emplace_back(
              l.id,
              absl::StrCat(who, "; it is kept: ",
                           l.world ? "world sessions are not reaped as orphans (the other ranks' "
                                     "trainers may still step it); close it, or use "
                                     "--session_idle_timeout"
                           : name.empty() ? absl::StrCat("orphans are not reaped (", flag, "=0)")
                                          : absl::StrCat("named sessions wait for AttachSession (",
                                                         flag, "=0)")));
        }
        continue;
      }
      if (first) {
        lines.emplace_back(l.id, absl::StrCat(who, "; it is closed once unused for ", flag, "=",
                                              absl::FormatDuration(grace)));
      }
      const absl::Time since = std::max(t.orphan_since, l.last_used);
      if (now - since < grace) continue;
      due.push_back(
          Due{l.id, absl::StrCat("session ", l.id,
                                 name.empty() ? std::string() : absl::StrCat(" ('", name, "')"),
                                 " reaped (orphan): its trainer process(es) (pid ",
                                 absl::StrJoin(t.exited, ", "), ") exited and it was unused for ",
                                 absl::FormatDuration(now - since), " (", flag, "=",
                                 absl::FormatDuration(grace), "); closing it")});
    }
  }
  for (const auto& [id, message] : lines) {
    ScopedLogContext log_context(id);
    DIOND_LOG(INFO) << message;
  }
  for (const auto& [id, weak] : cancel) {
    std::shared_ptr<Session> s = weak.lock();
    if (s == nullptr || !s->CancelDoorbellWaits()) continue;
    ScopedLogContext log_context(id);
    DIOND_LOG(WARNING) << "session " << id << ": its trainer process(es) exited during an "
                       << "overlapped step; that step's wait for the gradients doorbells is "
                       << "cancelled (nothing committed)";
  }
  for (const Due& d : due) {
    // For good: --recover would bring it back with no process left to watch.
    if (CloseReaped(d.id, "orphan", d.why, /*for_good=*/true)) continue;
    // The checkpoint failed: try again a grace later, not at every look.
    absl::MutexLock lock(&mu_);
    if (auto it = trainers_.find(d.id); it != trainers_.end()) it->second.orphan_since = now;
  }
}

void SessionManager::DrainQueuedSteps() {
  std::vector<std::shared_ptr<Session>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  for (auto& s : all) {
    if (int64_t step = s->DrainQueuedStep(/*closing=*/true); step != 0) {
      DIOND_LOG(INFO) << "session " << s->id() << ": the asynchronous step " << step
                      << " ended before the daemon stopped";
    }
  }
}

void SessionManager::CancelDoorbellWaits() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) s->CancelDoorbellWaits();
}

}  // namespace diond::session
