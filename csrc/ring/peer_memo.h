// Peer access per (device, peer) pair with failures remembered.
//
// torch's at::cuda::get_p2p_access records a pair as allowed before it enables access; when
// enabling then throws, every later call returns "allowed" for a pair that has no access, and
// a kernel would read the peer's memory without it. PeerAccessMemo keeps the first failure of
// each pair and answers it on every later call, without asking torch again, so the pair's
// hops stay staged. Successes and plain refusals are torch's to cache. No CUDA or torch here:
// tests/test_peer_memo.py compiles it with the host compiler.
#pragma once

#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace rr {

class PeerAccessMemo {
 public:
  // Whether `device` may read `peer`'s memory: enable(device, peer) answers (and may throw)
  // unless the pair failed before. On false from a failure, *why holds its first line.
  template <class Enable>
  bool get(int device, int peer, Enable&& enable, std::string* why) {
    const std::pair<int, int> key{device, peer};
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = failed_.find(key);
      if (it != failed_.end()) {
        *why = it->second;
        return false;
      }
    }
    try {
      return enable(device, peer);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      msg = msg.substr(0, msg.find('\n'));
      std::lock_guard<std::mutex> lock(mu_);
      failed_.emplace(key, msg);
      *why = msg;
      return false;
    }
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, int>, std::string> failed_;
};

}  // namespace rr
