#include "p2p.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>

namespace rr {
namespace dist {

namespace {

constexpr uint64_t kFrameMagic = 0x67736d3270707272ULL;  // "rrpp2msg"
constexpr int64_t kFrameBytes = 64;
// Bytes copied between two publishes: the reader starts on a piece while the writer copies
// the next one, instead of waiting for a whole ring.
constexpr int64_t kPiece = 64 << 10;
// Longest sleep while operations are pending: how often faults are looked for.
constexpr std::chrono::milliseconds kFaultPoll(50);
constexpr std::chrono::milliseconds kLivenessPeriod(200);

void ring_put(char* ring, int64_t size, uint64_t pos, const void* src, int64_t n) {
  const int64_t off = int64_t(pos % uint64_t(size));
  const int64_t first = std::min(n, size - off);
  if (first > 0) std::memcpy(ring + off, src, size_t(first));  // src is null for 0 bytes
  if (n > first) std::memcpy(ring, static_cast<const char*>(src) + first, size_t(n - first));
}

void ring_get(const char* ring, int64_t size, uint64_t pos, void* dst, int64_t n) {
  const int64_t off = int64_t(pos % uint64_t(size));
  const int64_t first = std::min(n, size - off);
  if (first > 0) std::memcpy(dst, ring + off, size_t(first));  // dst is null for 0 bytes
  if (n > first) std::memcpy(static_cast<char*>(dst) + first, ring, size_t(n - first));
}

std::string frame_dtype(const char (&name)[kDtypeNameBytes]) {
  return std::string(name, strnlen(name, kDtypeNameBytes));
}

std::string seconds_text(std::chrono::steady_clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s",
                double(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()) / 1e9);
  return buf;
}

}  // namespace

P2P::P2P(HostGroup& g)
    : g_(g),
      rank_(g.rank()),
      nranks_(g.nranks()),
      ring_(g.p2p_ring_bytes()),
      timeout_ns_(g.timeout().count()),
      sends_(size_t(g.nranks())),
      rx_(size_t(g.nranks())),
      sent_(size_t(g.nranks()), 0),
      next_number_(size_t(g.nranks()), 1),
      next_liveness_check_(Clock::now()) {}

void P2P::post(const P2POp& op) {
  if (op.bytes < 0) throw std::invalid_argument("ringreduce: negative message size");
  if (op.send ? (op.peer < 0 || op.peer >= nranks_)
              : (op.peer != kAnySource && (op.peer < 0 || op.peer >= nranks_)))
    throw std::invalid_argument("ringreduce: point-to-point peer " + std::to_string(op.peer) +
                                " is not a rank of this group");
  if (op.dtype.size() >= kDtypeNameBytes)
    throw std::invalid_argument("ringreduce: dtype name '" + op.dtype + "' is too long");
  Op o;
  o.op = op;
  touch(o);
  if (op.send) {
    o.number = ++sends_posted_;
    sends_[size_t(op.peer)].push_back(std::move(o));
  } else {
    o.number = ++recvs_posted_;
    recvs_.push_back(std::move(o));
    fresh_.push_back(&recvs_.back());
  }
}

void P2P::interrupt() {
  interrupted_.store(true);
  g_.ring_own_bell();
}

void P2P::touch(Op& op) {
  op.last = Clock::now();
  op.deadline = op.last + std::chrono::nanoseconds(timeout_ns_.load());
}

size_t P2P::pending() const {
  size_t n = recvs_.size();
  for (const auto& q : sends_) n += q.size();
  return n;
}

std::vector<P2PDone> P2P::progress(std::chrono::nanoseconds max_wait) {
  std::vector<P2PDone> done;
  const auto until = Clock::now() + max_wait;
  const Header* own = g_.header(rank_);
  for (;;) {
    if (failed_.empty() && own->state.load(std::memory_order_acquire) != kLive)
      failed_ = own->message;
    if (!failed_.empty()) {
      fresh_.clear();
      fail_all(nullptr, failed_, done);
      return done;
    }
    // A receive posted since the last call first looks among the unmatched messages.
    while (!fresh_.empty() && failed_.empty()) {
      Op* r = fresh_.front();
      fresh_.pop_front();
      match_posted(r, done);
    }
    const uint32_t seen = own->p2p_bell.load(std::memory_order_seq_cst);
    bool moved = step(done);
    if (!done.empty()) return done;
    if (interrupted_.exchange(false)) return done;
    if (moved) continue;
    auto now = Clock::now();
    if (pending() != 0) {
      const bool liveness = now >= next_liveness_check_;
      if (liveness) next_liveness_check_ = now + kLivenessPeriod;
      const Op* culprit = nullptr;
      std::string why;
      auto look = [&](const Op& o) {
        if (!why.empty()) return;
        why = problem(o, now, liveness);
        culprit = &o;
      };
      for (const auto& q : sends_) {
        for (const Op& s : q) look(s);
      }
      for (const Op& r : recvs_) look(r);
      if (!why.empty()) {
        // A peer publishes its last bytes before it changes state or exits: what it sent is
        // visible now, and may still complete the operation.
        moved = step(done);
        if (!done.empty()) return done;
        if (moved) continue;
        fail_all(culprit, why, done);
        return done;
      }
    }
    if (now >= until) return done;
    auto left = until - now;
    if (pending() != 0 && left > kFaultPoll) left = kFaultPoll;
    g_.wait_bell(seen, std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
  }
}

bool P2P::step(std::vector<P2PDone>& done) {
  bool moved = false;
  for (int q = 0; q < nranks_ && failed_.empty(); ++q) moved = push(q, done) || moved;
  for (int p = 0; p < nranks_ && failed_.empty(); ++p) moved = drain(p, done) || moved;
  return moved;
}

bool P2P::push(int dest, std::vector<P2PDone>& done) {
  auto& queue = sends_[size_t(dest)];
  if (queue.empty()) return false;
  P2PCounters* mine = g_.p2p_counters(rank_);
  const P2PCounters* theirs = g_.p2p_counters(dest);
  char* ring = g_.p2p_ring(rank_, dest);
  uint64_t& sent = sent_[size_t(dest)];
  bool moved = false;
  while (!queue.empty()) {
    Op& s = queue.front();
    const uint64_t consumed = theirs->consumed[rank_].value.load(std::memory_order_acquire);
    int64_t space = ring_ - int64_t(sent - consumed);
    int64_t wrote = 0;
    if (!s.framed && space >= kFrameBytes) {
      Frame f{};
      f.magic = kFrameMagic;
      f.number = next_number_[size_t(dest)]++;
      f.tag = s.op.tag;
      f.bytes = s.op.bytes;
      std::memcpy(f.dtype, s.op.dtype.data(), s.op.dtype.size());
      ring_put(ring, ring_, sent, &f, kFrameBytes);
      sent += uint64_t(kFrameBytes);
      space -= kFrameBytes;
      wrote += kFrameBytes;
      s.framed = true;
    }
    if (s.framed) {
      const int64_t n = std::min({space, s.op.bytes - s.moved, kPiece});
      if (n > 0) {
        ring_put(ring, ring_, sent, static_cast<const char*>(s.op.data) + s.moved, n);
        sent += uint64_t(n);
        s.moved += n;
        wrote += n;
      }
    }
    if (wrote == 0) break;
    mine->sent[dest].value.store(sent, std::memory_order_release);
    g_.ring_bell(dest);
    touch(s);
    moved = true;
    if (s.framed && s.moved == s.op.bytes) {
      done.push_back(P2PDone{s.op.id, dest, ""});
      queue.pop_front();
    }
  }
  return moved;
}

bool P2P::drain(int source, std::vector<P2PDone>& done) {
  Rx& rx = rx_[size_t(source)];
  const P2PCounters* theirs = g_.p2p_counters(source);
  P2PCounters* mine = g_.p2p_counters(rank_);
  const char* ring = g_.p2p_ring(source, rank_);
  bool moved = false;
  for (;;) {
    const uint64_t avail =
        theirs->sent[rank_].value.load(std::memory_order_acquire) - rx.consumed;
    int64_t took = 0;
    if (!rx.open) {
      if (avail < uint64_t(kFrameBytes)) break;
      ring_get(ring, ring_, rx.consumed, &rx.frame, kFrameBytes);
      rx.consumed += uint64_t(kFrameBytes);
      took = kFrameBytes;
      open_frame(source, rx, done);
      if (!failed_.empty()) return true;
    } else {
      const int64_t n = std::min({int64_t(avail), rx.frame.bytes - rx.got, kPiece});
      if (n > 0) {
        char* dst = rx.recv != nullptr ? static_cast<char*>(rx.recv->op.data)
                                       : rx.stash->data.get();
        ring_get(ring, ring_, rx.consumed, dst + rx.got, n);
        rx.consumed += uint64_t(n);
        rx.got += n;
        took = n;
        if (rx.recv != nullptr) {
          rx.recv->moved = rx.got;
          touch(*rx.recv);
        }
        if (rx.stash != nullptr) {
          rx.stash->got = rx.got;
          if (rx.stash->claimed != nullptr) touch(*rx.stash->claimed);
        }
      }
    }
    if (rx.open && rx.got == rx.frame.bytes) close_frame(rx, done);
    if (took == 0) break;
    mine->consumed[source].value.store(rx.consumed, std::memory_order_release);
    g_.ring_bell(source);
    moved = true;
  }
  return moved;
}

void P2P::open_frame(int source, Rx& rx, std::vector<P2PDone>& done) {
  const Frame& f = rx.frame;
  if (f.magic != kFrameMagic || f.number != rx.next_number || f.bytes < 0) {
    fail_all(nullptr,
             "ringreduce: the point-to-point channel from rank " + std::to_string(source) +
                 " to rank " + std::to_string(rank_) + " is corrupted: expected message #" +
                 std::to_string(rx.next_number) + ", found a frame numbered " +
                 std::to_string(f.number) + " of " + std::to_string(f.bytes) + " bytes",
             done);
    return;
  }
  ++rx.next_number;
  rx.open = true;
  rx.got = 0;
  rx.recv = nullptr;
  rx.stash = nullptr;
  for (Op& r : recvs_) {
    if (r.source >= 0 || r.op.tag != f.tag) continue;
    if (r.op.peer != source && r.op.peer != kAnySource) continue;
    const std::string bad = check_message(r, source, f);
    if (!bad.empty()) {
      fail_all(&r, bad, done);
      return;
    }
    r.source = source;
    rx.recv = &r;
    return;
  }
  // No receive wants it yet: keep it here, so later messages (other tags) can pass.
  unexpected_.emplace_back();
  Unexpected& u = unexpected_.back();
  u.source = source;
  u.frame = f;
  try {
    u.data.reset(new char[size_t(std::max<int64_t>(f.bytes, 1))]);
  } catch (const std::bad_alloc&) {
    unexpected_.pop_back();
    fail_all(nullptr,
             "ringreduce: rank " + std::to_string(rank_) + " could not buffer a message of " +
                 std::to_string(f.bytes) + " bytes from rank " + std::to_string(source) +
                 " (tag " + std::to_string(f.tag) + ") that no receive has matched yet: out "
                 "of memory",
             done);
    return;
  }
  rx.stash = &u;
}

void P2P::close_frame(Rx& rx, std::vector<P2PDone>& done) {
  rx.open = false;
  Op* r = rx.recv;
  Unexpected* u = rx.stash;
  rx.recv = nullptr;
  rx.stash = nullptr;
  if (r != nullptr) {
    complete_recv(r, done);
    return;
  }
  if (u->claimed == nullptr) return;
  r = u->claimed;
  // An empty message's pointers may be null: no memcpy for 0 bytes.
  if (u->frame.bytes > 0) std::memcpy(r->op.data, u->data.get(), size_t(u->frame.bytes));
  r->moved = u->frame.bytes;
  unexpected_.remove_if([u](const Unexpected& x) { return &x == u; });
  complete_recv(r, done);
}

void P2P::complete_recv(Op* r, std::vector<P2PDone>& done) {
  done.push_back(P2PDone{r->op.id, r->source, ""});
  recvs_.remove_if([r](const Op& x) { return &x == r; });
}

void P2P::match_posted(Op* r, std::vector<P2PDone>& done) {
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    Unexpected& u = *it;
    if (u.claimed != nullptr || u.frame.tag != r->op.tag) continue;
    if (r->op.peer != kAnySource && u.source != r->op.peer) continue;
    const std::string bad = check_message(*r, u.source, u.frame);
    if (!bad.empty()) {
      fail_all(r, bad, done);
      return;
    }
    r->source = u.source;
    if (u.got < u.frame.bytes) {
      u.claimed = r;  // still arriving: close_frame completes the receive
      return;
    }
    if (u.frame.bytes > 0) std::memcpy(r->op.data, u.data.get(), size_t(u.frame.bytes));
    r->moved = u.frame.bytes;
    unexpected_.erase(it);
    complete_recv(r, done);
    return;
  }
}

std::string P2P::check_message(const Op& r, int source, const Frame& f) const {
  const std::string dtype = frame_dtype(f.dtype);
  if (f.bytes == r.op.bytes && dtype == r.op.dtype) return "";
  return "ringreduce: " + describe(r) + " on rank " + std::to_string(rank_) + ": rank " +
         std::to_string(source) + " sent " + std::to_string(f.bytes) + " bytes of " + dtype +
         " (its message #" + std::to_string(f.number) + " to this rank) but the tensor holds " +
         std::to_string(r.op.bytes) + " bytes of " + r.op.dtype +
         " (a receive needs the size and dtype of the matching send)";
}

std::string P2P::describe(const Op& op) const {
  // A receive from any rank is torch's (and gloo's) recvAnySource.
  const bool any = !op.op.send && op.op.peer == kAnySource;
  std::string s = op.op.send ? "send #" : any ? "recvAnySource #" : "recv #";
  s += std::to_string(op.number);
  if (op.op.send) {
    s += " to rank " + std::to_string(op.op.peer);
  } else if (!any) {
    s += " from rank " + std::to_string(op.op.peer);
  }
  return s + " (tag " + std::to_string(op.op.tag) + ", " + std::to_string(op.op.bytes) +
         " bytes)";
}

std::string P2P::unexpected_from(int source) const {
  std::string s;
  int shown = 0;
  for (const Unexpected& u : unexpected_) {
    if (u.claimed != nullptr || (source != kAnySource && u.source != source)) continue;
    if (shown == 4) {
      s += ", ...";
      break;
    }
    s += (shown++ == 0 ? "" : ", ") + std::string("tag ") + std::to_string(u.frame.tag) +
         " from rank " + std::to_string(u.source) + " (" + std::to_string(u.frame.bytes) +
         " bytes of " + frame_dtype(u.frame.dtype) + ")";
  }
  return shown == 0 ? "" : "; unmatched messages waiting here: " + s;
}

std::string P2P::peer_problem(const Op& op, int peer, bool check_liveness) const {
  const Header* h = g_.header(peer);
  const uint32_t state = h->state.load(std::memory_order_acquire);
  std::string what;
  if (state == kAborted) {
    what = "failed";
  } else if (state == kClosed) {
    what = "closed its process group";
  } else if (check_liveness && g_.peer_dead(peer)) {
    what = "exited";
  } else {
    return "";
  }
  std::string s = "ringreduce: " + describe(op) + " on rank " + std::to_string(rank_) +
                  " failed: rank " + std::to_string(peer) + " (pid " + std::to_string(h->pid) +
                  ") " + what + " while this rank waited for it; ";
  if (op.op.send) {
    s += std::to_string(op.moved) + " of " + std::to_string(op.op.bytes) + " bytes sent";
  } else if (op.source >= 0) {
    s += std::to_string(op.moved) + " of " + std::to_string(op.op.bytes) + " bytes received";
  } else {
    s += "no matching message had arrived";
  }
  if (state == kAborted) s += "; rank " + std::to_string(peer) + " reports: " + h->message;
  return s;
}

std::string P2P::problem(const Op& op, Clock::time_point now, bool check_liveness) const {
  if (op.op.send || op.op.peer != kAnySource || op.source >= 0) {
    const int peer = op.source >= 0 ? op.source : op.op.peer;
    if (peer != rank_) {
      const std::string s = peer_problem(op, peer, check_liveness);
      if (!s.empty()) return s;
    }
  } else {
    // Any source: a failed or dead peer fails the group; peers that closed their group
    // normally only matter once no peer is left that could still send.
    int open = 0;
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      const uint32_t state = g_.header(p)->state.load(std::memory_order_acquire);
      if (state == kClosed) continue;
      ++open;
      const std::string s = peer_problem(op, p, check_liveness);
      if (!s.empty()) return s;
    }
    if (open == 0 && nranks_ > 1)
      return "ringreduce: " + describe(op) + " on rank " + std::to_string(rank_) +
             " failed: every other rank closed its process group while this rank waited; no "
             "matching message had arrived" + unexpected_from(kAnySource);
  }
  if (now < op.deadline) return "";
  std::string s = "ringreduce: " + describe(op) + " on rank " + std::to_string(rank_) +
                  " timed out (no progress for " + seconds_text(now - op.last) +
                  ", the process group's timeout) waiting for ";
  if (op.op.send) {
    const int q = op.op.peer;
    s += "rank " + std::to_string(q) + " (pid " + std::to_string(g_.header(q)->pid) +
         ") to read its messages; " + std::to_string(op.moved) + " of " +
         std::to_string(op.op.bytes) + " bytes sent (a rank reads point-to-point messages "
         "once it has made a point-to-point call of its own)";
  } else if (op.source >= 0) {
    s += "rank " + std::to_string(op.source) + " (pid " +
         std::to_string(g_.header(op.source)->pid) + ") to send the rest of its message; " +
         std::to_string(op.moved) + " of " + std::to_string(op.op.bytes) + " bytes received";
  } else if (op.op.peer == kAnySource) {
    s += "a matching message from any rank" + unexpected_from(kAnySource);
  } else {
    s += "a matching message from rank " + std::to_string(op.op.peer) + " (pid " +
         std::to_string(g_.header(op.op.peer)->pid) + ")" + unexpected_from(op.op.peer);
  }
  return s;
}

void P2P::fail_all(const Op* culprit, const std::string& first, std::vector<P2PDone>& done) {
  if (failed_.empty()) {
    failed_ = first;
    g_.fail(first);
  }
  auto report = [&](const Op& o) {
    std::string msg = &o == culprit ? first
                                    : "ringreduce: " + describe(o) + " on rank " +
                                          std::to_string(rank_) + ": this process group "
                                          "failed and cannot be used any more: " + failed_;
    done.push_back(P2PDone{o.op.id, o.source >= 0 ? o.source : o.op.peer, std::move(msg)});
  };
  for (auto& q : sends_) {
    for (const Op& s : q) report(s);
    q.clear();
  }
  for (const Op& r : recvs_) report(r);
  recvs_.clear();
}

}  // namespace dist
}  // namespace rr
