// Point-to-point messages between the ranks of a HostGroup (send/recv, isend/irecv, receive
// from any source). Torch-free, host memory only.
//
// Channels: every ordered pair (sender s, receiver q), s == q included, has a byte ring in s's
// segment (HostGroup::p2p_ring(s, q)) and two monotone counters: sent[q] in s's segment (bytes
// s has written) and consumed[s] in q's segment (bytes q has read). The writer copies, then
// publishes with a release store; the reader acquires before it copies out and publishes its
// own counter after, so no unread byte is overwritten. Each side writes only its own segment.
// A message is a 64-byte frame (number, tag, size, dtype) followed by its payload; both may
// wrap around the ring, and a message larger than the ring streams through it in pieces.
//
// Matching (as MPI's): the receiver reads each channel's frames in order. A frame goes to the
// oldest posted receive that is still unmatched and takes its tag from that sender (or from
// any sender); with none, the payload is drained into private memory ("unexpected"), where a
// later receive finds it. Messages therefore match per (sender, tag) in send order, and a
// send never waits for its receive: only for ring space, which the receiver's p2p thread frees
// whenever it runs. A send completes when its last byte is in the ring.
//
// Progress: one thread per rank (the backend's p2p thread) calls progress(). Nothing in it
// blocks on one operation: each pass moves every pending send and drains every channel as far
// as it can, then sleeps on this rank's bell, which peers ring after each publish. Why a
// thread of its own rather than the collectives' queue: a send waiting for ring space, or a
// receive waiting for its message, must not hold up (or be held up by) a collective whose peer
// is itself blocked the other way. Here a rank's point-to-point traffic moves whatever its
// collective thread is doing, so isend-then-irecv on both sides, sends before receives on both
// sides, large messages and ranks sharing a GPU cannot deadlock.
//
// Faults: an operation fails when it cannot move and its deadline (the group's timeout after
// it was posted or last moved: a long transfer that keeps moving never times out) has passed, the peer it needs failed, closed its group without sending,
// or exited (checked every 200 ms, as HostGroup::wait does), or this rank's group failed. The
// message names the operation, its peer and tag, and how many bytes had moved. The first
// failure fails the whole group (HostGroup::fail), as a failed collective does.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "host_group.h"

namespace rr {
namespace dist {

constexpr int kAnySource = -1;
constexpr size_t kDtypeNameBytes = 24;

struct P2POp {
  uint64_t id;        // the caller's handle, returned in P2PDone
  bool send;
  int peer;           // destination (send) or source (receive); kAnySource: any (receive only)
  int64_t tag;
  void* data;         // send: read from; receive: written to (stays valid until done)
  int64_t bytes;
  std::string dtype;  // element type name, compared between a message and its receive
};

struct P2PDone {
  uint64_t id;
  int peer;           // a receive's sender (the one that matched, for kAnySource)
  std::string error;  // empty on success
};

class P2P {
 public:
  explicit P2P(HostGroup& g);
  P2P(const P2P&) = delete;
  P2P& operator=(const P2P&) = delete;

  void set_timeout(std::chrono::nanoseconds t) { timeout_ns_.store(t.count()); }
  // Adds an operation. Only the thread that calls progress() may call this.
  void post(const P2POp& op);
  // Moves everything it can; returns as soon as some operations completed or failed, after
  // `max_wait` with nothing to report, or when interrupt() was called.
  std::vector<P2PDone> progress(std::chrono::nanoseconds max_wait);
  // Makes a running (or the next) progress() return. Any thread.
  void interrupt();
  size_t pending() const;

 private:
  using Clock = std::chrono::steady_clock;

  struct Frame {
    uint64_t magic;
    uint64_t number;  // 1, 2, ... per (sender, receiver)
    int64_t tag;
    int64_t bytes;
    char dtype[kDtypeNameBytes];
    uint64_t reserved;
  };
  static_assert(sizeof(Frame) == 64, "a frame is 64 bytes");

  struct Unexpected;
  struct Op {
    P2POp op;
    uint64_t number;  // "send #3": numbered per direction on this rank
    Clock::time_point last;      // when it was posted or last moved
    Clock::time_point deadline;  // last + the group's timeout
    int64_t moved = 0;      // payload bytes written (send) or received (receive)
    bool framed = false;    // send: its frame is in the ring
    int source = -1;        // receive: the matched sender, -1 while unmatched
  };
  struct Unexpected {
    int source;
    Frame frame;
    std::unique_ptr<char[]> data;
    int64_t got = 0;
    Op* claimed = nullptr;  // a receive that matched it before it was fully drained
  };
  struct Rx {                // this rank's reading side of one channel
    uint64_t consumed = 0;
    uint64_t next_number = 1;
    bool open = false;       // a frame was read; its payload is being drained
    Frame frame{};
    Op* recv = nullptr;      // where the payload goes: a receive, or
    Unexpected* stash = nullptr;
    int64_t got = 0;
  };

  bool drain(int source, std::vector<P2PDone>& done);
  bool push(int dest, std::vector<P2PDone>& done);
  bool step(std::vector<P2PDone>& done);
  void open_frame(int source, Rx& rx, std::vector<P2PDone>& done);
  void close_frame(Rx& rx, std::vector<P2PDone>& done);
  void complete_recv(Op* r, std::vector<P2PDone>& done);
  void touch(Op& op);  // it moved (or was posted): its deadline starts again
  void match_posted(Op* r, std::vector<P2PDone>& done);
  std::string check_message(const Op& r, int source, const Frame& f) const;
  // Why an operation that cannot move should fail now, or "" (it may still move).
  std::string problem(const Op& op, Clock::time_point now, bool check_liveness) const;
  std::string peer_problem(const Op& op, int peer, bool check_liveness) const;
  std::string describe(const Op& op) const;
  std::string unexpected_from(int source) const;
  // Reports `first` for `culprit` and fails the group and every other pending operation.
  void fail_all(const Op* culprit, const std::string& first, std::vector<P2PDone>& done);

  HostGroup& g_;
  const int rank_;
  const int nranks_;
  const int64_t ring_;
  std::atomic<int64_t> timeout_ns_;
  std::atomic<bool> interrupted_{false};
  std::vector<std::deque<Op>> sends_;   // per destination, in posting order
  std::list<Op> recvs_;                 // in posting order
  std::deque<Op*> fresh_;               // receives posted since the last progress()
  std::list<Unexpected> unexpected_;    // in arrival order
  std::vector<Rx> rx_;                  // per source
  std::vector<uint64_t> sent_;          // per destination: bytes written into its ring
  std::vector<uint64_t> next_number_;   // per destination: the next frame's number
  uint64_t sends_posted_ = 0;
  uint64_t recvs_posted_ = 0;
  Clock::time_point next_liveness_check_;
  std::string failed_;                  // set at the first failure; everything later fails
};

}  // namespace dist
}  // namespace rr
