// The backend's entries in torch's flight recorder: the ring buffer that ProcessGroupGloo and
// ProcessGroupNCCL record every collective in (torch/csrc/distributed/c10d/FlightRecorder.hpp),
// which torch._C._distributed_c10d._dump_fr_trace / _dump_fr_trace_json dump and
// `python -m torch.distributed.flight_recorder.fr_trace` analyses.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
//
// Reaching torch's recorder. FlightRecorder<c10::Event>::get() is an inline function whose
// static instance lives in libtorch_cpu.so with hidden visibility (torch 2.11 to 2.14.1 export
// none of the recorder's members), so calling get() here would make a second, private recorder
// that no dump of torch's ever shows. The instance is found instead through libtorch_cpu.so's
// own symbol table (the object holding the exported c10d::dump_fr_trace_json, its file read
// once per process); its members are the public fields of the header this extension is built
// against, and every access takes the recorder's own mutex, as torch's code does. Where the
// library has no symbol table (a stripped build), recording stays off and the backend says so
// once.
//
// When: only where TORCH_FR_BUFFER_SIZE (or its older name TORCH_NCCL_TRACE_BUFFER_SIZE) is set
// to a positive size, decided once per process. torch's recorder is on by default (2000
// entries) and gloo records into it whatever the environment; ringreduce records only when
// asked, so that a call costs one branch when nobody looks (bench/RESULTS.md has both costs).
//
// What: an entry per collective and point-to-point operation, as gloo's: profiling name
// "ringreduce:<op>" (the analyzer's and NCCL's names: all_reduce, _all_gather_base,
// "send 0->1", ...), the group's name and description, collective and p2p sequence numbers and
// the op id, input and output sizes and dtypes (per-rank blocks of all_gather, gather, scatter
// and reduce_scatter as one [world, ...] size, as gloo records them), the caller's stack (Python,
// and C++ under TORCH_FR_CPP_STACK=1), the timeout. Unlike gloo's, the entries move on to
// "started" when the collective starts running (CPU: its thread takes it up; CUDA: its start
// event has completed, seen by the watchdog) and to "completed" when it has finished (CUDA: its
// end event), then are retired; a failed one is retired without completing. With
// TORCH_NCCL_ENABLE_TIMING=1 (torch's knob for NCCL) completed entries carry duration_ms (CPU:
// the host's time from start to end; CUDA: the events' elapsed time).
//
// Dumps: on the first failure of a group (a timeout, a peer that failed or disagreed, an abort)
// every rank of it writes torch's whole recorder through torch's DebugInfoWriter (one file per
// rank: TORCH_FR_DUMP_TEMP_FILE + global rank, as ProcessGroupNCCL's dump on timeout), unless
// TORCH_NCCL_DUMP_ON_TIMEOUT=0. A rank that is in no collective at the time (the one that never
// called it) learns of the failure from its peers' shared-memory headers: a thread of the group
// polls them (every kPeerPollMs) while recording is on, so its dump is there for the analyzer
// too.
#pragma once

#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/extension.h>

#include <c10/util/ApproximateClock.h>
#include <c10/util/thread_name.h>

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backend_common.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

using TorchRecorder = c10d::FlightRecorder<c10::Event>;

// ---- finding torch's recorder --------------------------------------------------------------

// The loaded object whose segments hold `addr`: its file and load bias.
struct LoadedObject {
  std::string path;
  uintptr_t bias = 0;
  bool found = false;
};

inline LoadedObject object_holding(const void* addr) {
  struct Search {
    uintptr_t addr;
    LoadedObject out;
  } search{reinterpret_cast<uintptr_t>(addr), {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* s = static_cast<Search*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const uintptr_t low = info->dlpi_addr + ph.p_vaddr;
          if (s->addr >= low && s->addr < low + ph.p_memsz) {
            s->out = LoadedObject{info->dlpi_name ? info->dlpi_name : "", info->dlpi_addr, true};
            return 1;
          }
        }
        return 0;
      },
      &search);
  return search.out;
}

// The value (link-time address) of the data object `name` of `bytes` bytes in the symbol table
// (.symtab, local symbols included) of the ELF file `path`; 0 with `why` set where there is
// none. Only the symbol table and the names of candidates of that type and size are read.
inline uintptr_t symtab_object(const std::string& path, const char* name, size_t bytes,
                               std::string* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *why = "cannot open " + path + ": " + std::strerror(errno);
    return 0;
  }
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0 && st.st_size > 0;
  void* map = sized ? ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0)
                    : MAP_FAILED;
  ::close(fd);
  if (map == MAP_FAILED) {
    *why = "cannot map " + path;
    return 0;
  }
  const size_t size = size_t(st.st_size);
  const Finally unmap([&] { ::munmap(map, size); });
  const auto* base = static_cast<const unsigned char*>(map);
  const auto fits = [&](uint64_t offset, uint64_t len) {
    return offset <= size && len <= size - offset;
  };
  const auto* eh = reinterpret_cast<const ElfW(Ehdr)*>(base);
  if (!fits(0, sizeof(ElfW(Ehdr))) || std::memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 ||
      eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_shentsize != sizeof(ElfW(Shdr)) ||
      !fits(eh->e_shoff, uint64_t(eh->e_shnum) * sizeof(ElfW(Shdr)))) {
    *why = path + " is not a 64-bit ELF file this code can read";
    return 0;
  }
  const auto* sections = reinterpret_cast<const ElfW(Shdr)*>(base + eh->e_shoff);
  const size_t name_len = std::strlen(name);
  for (size_t s = 0; s < eh->e_shnum; ++s) {
    const ElfW(Shdr)& symtab = sections[s];
    if (symtab.sh_type != SHT_SYMTAB || symtab.sh_link >= eh->e_shnum) continue;
    const ElfW(Shdr)& strtab = sections[symtab.sh_link];
    if (!fits(symtab.sh_offset, symtab.sh_size) || !fits(strtab.sh_offset, strtab.sh_size)) {
      continue;
    }
    const auto* syms = reinterpret_cast<const ElfW(Sym)*>(base + symtab.sh_offset);
    const char* names = reinterpret_cast<const char*>(base + strtab.sh_offset);
    for (size_t i = 0; i < symtab.sh_size / sizeof(ElfW(Sym)); ++i) {
      const ElfW(Sym)& sym = syms[i];
      if (ELF64_ST_TYPE(sym.st_info) != STT_OBJECT || sym.st_size != bytes ||
          sym.st_shndx == SHN_UNDEF || sym.st_name + name_len >= strtab.sh_size) {
        continue;
      }
      if (std::memcmp(names + sym.st_name, name, name_len + 1) == 0) return sym.st_value;
    }
  }
  *why = path + " has no symbol table entry for torch's recorder (a stripped build?)";
  return 0;
}

// FlightRecorder<c10::Event>::get()'s instance in libtorch_cpu.so, made there if torch has
// not made it yet; null with `why` set where it cannot be found.
inline TorchRecorder* find_torch_recorder(std::string* why) {
  // The mangled name of the function-local static `instance` in FlightRecorder<c10::Event>::get()
  // (the same in torch 2.11 to 2.14.1).
  static constexpr const char* kInstance =
      "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance";
  const LoadedObject torch_cpu =
      object_holding(reinterpret_cast<const void*>(&c10d::dump_fr_trace_json));
  if (!torch_cpu.found || torch_cpu.path.empty()) {
    *why = "the library holding c10d::dump_fr_trace_json was not found among the loaded objects";
    return nullptr;
  }
  const uintptr_t value = symtab_object(torch_cpu.path, kInstance, sizeof(void*), why);
  if (value == 0) return nullptr;
  auto** slot = reinterpret_cast<TorchRecorder**>(torch_cpu.bias + value);
  TorchRecorder* fr = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (fr == nullptr) {
    // torch makes its recorder on first use: a dump of nothing makes it (and reads no entry).
    (void)c10d::dump_fr_trace_json(/*includeCollectives=*/false, /*onlyActive=*/false);
    fr = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  }
  if (fr == nullptr) *why = "torch's recorder was not made by a dump";
  return fr;
}

// ---- the process's settings ------------------------------------------------------------------

// The environment variable `names[i]` that is set, the first of them; nullptr where none is.
inline const char* first_set(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    const char* v = std::getenv(n);
    if (v != nullptr && *v != '\0') return v;
  }
  return nullptr;
}

// torch's spelling of a true or false knob (getCvarBool: 1/true/yes/y, case-insensitive).
inline bool cvar_bool(std::initializer_list<const char*> names, bool fallback) {
  const char* v = first_set(names);
  if (v == nullptr) return fallback;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  if (s == "1" || s == "true" || s == "yes" || s == "y") return true;
  if (s == "0" || s == "false" || s == "no" || s == "n") return false;
  return fallback;
}

struct FrSettings {
  TorchRecorder* fr = nullptr;  // null: recording is off
  bool timing = false;          // TORCH_NCCL_ENABLE_TIMING: durations
  bool dump_on_failure = true;  // TORCH_NCCL_DUMP_ON_TIMEOUT
  std::string why_off;          // why recording is off although it was asked for
};

// Decided once per process, at the first group made (the environment of that moment).
inline const FrSettings& fr_settings() {
  static const FrSettings settings = [] {
    FrSettings s;
    const char* size = first_set({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"});
    if (size == nullptr || std::strtol(size, nullptr, 10) <= 0) return s;
    TorchRecorder* fr = find_torch_recorder(&s.why_off);
    if (fr != nullptr && !fr->enabled_) {
      s.why_off = "torch's recorder is disabled (its buffer size, read when torch first used "
                  "it, is 0)";
      fr = nullptr;
    }
    s.fr = fr;
    s.timing = cvar_bool({"TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING"}, false);
    s.dump_on_failure = cvar_bool({"TORCH_NCCL_DUMP_ON_TIMEOUT"}, true);
    return s;
  }();
  return settings;
}

// ---- what an entry shows of a call ------------------------------------------------------------

// Sizes and dtypes of a call's inputs or outputs, as an entry stores them.
struct FrShapes {
  c10::SmallVector<int64_t, 4> dims;
  c10::SmallVector<int64_t, 8> sizes;
  std::vector<c10::ScalarType> dtypes;

  void add(c10::IntArrayRef shape, c10::ScalarType dtype) {
    dims.push_back(int64_t(shape.size()));
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    dtypes.push_back(dtype);
  }
  void add_each(c10::ArrayRef<at::Tensor> ts) {
    for (const at::Tensor& t : ts) add(t.sizes(), t.scalar_type());
  }
  // Per-rank blocks of one shape as one [blocks, ...] tensor, as gloo and NCCL record them.
  void add_stacked(int64_t blocks, const at::Tensor& block) {
    c10::SmallVector<int64_t, 5> shape{blocks};
    shape.insert(shape.end(), block.sizes().begin(), block.sizes().end());
    add(shape, block.scalar_type());
  }
};

// The analyzer's (and NCCL's) name of each of the backend's collectives, by the backend's own
// name for it (torch 2.11 types two of them OpType::COALESCED, so the OpType cannot tell).
inline const char* fr_op_name(const std::string& name) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"all_reduce_coalesced", "allreduce_coalesced"},
      {"all_gather_coalesced", "ALLGATHER_coalesced"},
      {"all_gather_into_tensor", "_all_gather_base"},
      {"reduce_scatter_tensor", "_reduce_scatter_base"},
      {"all_to_all_single", "all_to_all"},
  };
  for (const auto& [ours, theirs] : kNames) {
    if (name == ours) return theirs;
  }
  return nullptr;  // the same name
}

// Inputs and outputs as the entry of collective `name` shows them, from what the backend passes
// its queue (`inputs`: what the profiler shows; `outputs`: the Work's result).
inline std::pair<FrShapes, FrShapes> fr_shapes(const std::string& name,
                                               c10::ArrayRef<at::Tensor> inputs,
                                               c10::ArrayRef<at::Tensor> outputs, int world) {
  FrShapes in, out;
  if ((name == "reduce_scatter" || name == "scatter") && !inputs.empty()) {
    in.add_stacked(int64_t(inputs.size()), inputs[0]);
  } else {
    in.add_each(inputs);
  }
  if ((name == "all_gather" || name == "gather") && !outputs.empty()) {
    out.add_stacked(int64_t(outputs.size()), outputs[0]);
  } else if (name == "all_gather_coalesced") {
    for (const at::Tensor& t : inputs) out.add_stacked(world, t);
  } else {
    out.add_each(outputs);
  }
  return {std::move(in), std::move(out)};
}

// An entry: its id in the recorder and the recorder's epoch when it was made.
struct FrTrace {
  size_t id = 0;
  size_t epoch = 0;
  bool on = false;
};

// ---- one group's recording ----------------------------------------------------------------

class GroupRecorder {
 public:
  // How often a rank in no collective looks at its peers' headers for a failure (ms).
  static constexpr int kPeerPollMs = 100;
  // How long the thread that fails a group waits for its dump to be written (s): the error it
  // then raises may end the process. A process's first dump with stacks takes seconds: torch's
  // symbolizer imports torch._dynamo and ~800 modules (measured 3 to 22 s on the loaded 2-core
  // CI machine, torch 2.13).
  static constexpr int kDumpWaitS = 60;

  // `ranks`: the group's members as global ranks; `rank`: this rank in the group.
  GroupRecorder(const FrSettings& settings, std::vector<uint64_t> ranks, int rank,
                std::function<bool(int&, std::string&)> aborted_peer)
      : fr_(settings.fr),
        timing_(settings.timing),
        dump_on_failure_(settings.dump_on_failure),
        pg_id_(next_pg_id()),
        ranks_(std::move(ranks)),
        rank_(rank),
        aborted_peer_(std::move(aborted_peer)),
        status_(std::make_shared<c10d::ProcessGroupStatus>()) {
    if (dump_on_failure_) monitor_ = std::thread([this] { monitor(); });
  }
  ~GroupRecorder() { stop(); }
  GroupRecorder(const GroupRecorder&) = delete;
  GroupRecorder& operator=(const GroupRecorder&) = delete;

  bool timing() const { return timing_; }
  int global_rank() const {
    return size_t(rank_) < ranks_.size() ? int(ranks_[size_t(rank_)]) : rank_;
  }

  // A collective (`seq`: its collective sequence number, from 1).
  FrTrace collective(const c10d::Backend& b, const std::string& name, uint64_t seq,
                     c10::ArrayRef<at::Tensor> inputs, c10::ArrayRef<at::Tensor> outputs,
                     std::chrono::milliseconds timeout) {
    const char* fr_name = fr_op_name(name);
    auto [in, out] = fr_shapes(name, inputs, outputs, int(ranks_.size()));
    return record(b, "ringreduce:" + std::string(fr_name ? fr_name : name.c_str()), seq, in, out,
                  /*is_p2p=*/false, timeout);
  }

  // A send or receive of `t` (group ranks; `peer` < 0: a receive from any source, shown "*");
  // `collectives`: the collectives issued before it (its collective sequence number, as NCCL's).
  FrTrace p2p(const c10d::Backend& b, bool is_send, int peer, const at::Tensor& t,
              uint64_t collectives, std::chrono::milliseconds timeout) {
    const std::string other = peer < 0 ? "*" : std::to_string(peer);
    const std::string title = is_send ? "send " + std::to_string(b.getRank()) + "->" + other
                                      : "recv " + std::to_string(b.getRank()) + "<-" + other;
    FrShapes shapes;
    shapes.add(t.sizes(), t.scalar_type());
    return record(b, "ringreduce:" + title, collectives, shapes, shapes, /*is_p2p=*/true,
                  timeout);
  }

  // The operation started running (repeats are ignored).
  void started(const FrTrace& t) {
    if (!t.on) return;
    const std::lock_guard<std::mutex> held(fr_->mutex_);
    TorchRecorder::Entry* e = find(t);
    if (e == nullptr || e->time_discovered_started_) return;
    e->time_discovered_started_ = c10::getTime();
    if (!e->isP2P_) {
      status_->lastStartedSeq = int64_t(e->collective_seq_id_);
      status_->lastStartedWorkName = e->profiling_name_;
    }
  }

  // It finished (ok) or failed; either way it is retired. `gpu_ms`: its duration by CUDA events.
  void finished(const FrTrace& t, bool ok, std::optional<float> gpu_ms = std::nullopt) {
    if (!t.on) return;
    const std::lock_guard<std::mutex> held(fr_->mutex_);
    TorchRecorder::Entry* e = find(t);
    if (e == nullptr) return;
    e->retired_ = true;
    if (!ok) return;
    const c10::time_t now = c10::getTime();
    if (!e->time_discovered_started_) e->time_discovered_started_ = now;
    e->time_discovered_completed_ = now;
    if (timing_) {
      e->duration_ = gpu_ms ? *gpu_ms
                            : float(double(now - *e->time_discovered_started_) / 1e6);
    }
    if (!e->isP2P_) {
      status_->lastCompletedSeq = int64_t(e->collective_seq_id_);
      status_->lastCompletedWorkName = e->profiling_name_;
    }
  }

  // The group failed (its first failure): every rank dumps. Waits (bounded) for the dump unless
  // this thread holds the GIL, which the dump needs for the stacks.
  void group_failed(const std::string& why) {
    if (!dump_on_failure_) return;
    std::unique_lock<std::mutex> lock(mu_);
    if (stopped_) return;
    const uint64_t ticket = ++requested_;
    reason_ = why;
    cv_.notify_all();
    if (Py_IsInitialized() && PyGILState_Check()) return;
    done_cv_.wait_for(lock, std::chrono::seconds(kDumpWaitS),
                      [&] { return dumped_ >= ticket || stopped_; });
  }

  // Ends the monitor (before the transport closes: it reads the peers' headers); a dump in
  // progress is finished first.
  void stop() {
    {
      const std::lock_guard<std::mutex> held(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
    done_cv_.notify_all();
    if (monitor_.joinable()) monitor_.join();
  }

 private:
  static size_t next_pg_id() {
    static std::atomic<size_t> next{0};
    return next.fetch_add(1);
  }

  FrTrace record(const c10d::Backend& b, std::string title, uint64_t seq, const FrShapes& in,
                 const FrShapes& out, bool is_p2p, std::chrono::milliseconds timeout) {
    TorchRecorder::Entry e{};
    // The caller's stack, gathered outside the recorder's lock (it takes the GIL).
    e.traceback_ = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true,
                                                    fr_->capture_cpp_stack_);
    e.pg_id_ = pg_id_;
    e.pg_name_ = std::make_tuple(b.getGroupUid(), b.getGroupDesc());
    e.profiling_name_ = std::move(title);
    e.start_ = e.end_ = nullptr;  // the states are set here, not by events torch would query
    e.time_created_ = c10::getTime();
    e.timeout_ms_ = timeout.count();
    e.isP2P_ = is_p2p;
    e.input_dims_ = in.dims;
    e.input_dtypes_ = in.dtypes;
    e.output_dims_ = out.dims;
    e.output_dtypes_ = out.dtypes;
    e.sizes_ = in.sizes;
    e.sizes_.append(out.sizes.begin(), out.sizes.end());
    e.thread_id_ = std::this_thread::get_id();
    e.thread_name_ = c10::getThreadName();

    const std::lock_guard<std::mutex> held(fr_->mutex_);
    if (!fr_->enabled_ || fr_->max_entries_ == 0) return {};
    // torch's record_pg_ranks, at the first entry: torch names the group after making it.
    if (!ranks_recorded_) {
      fr_->pg_name_to_ranks_[e.pg_name_] = ranks_;
      ranks_recorded_ = true;
    }
    if (fr_->all_pg_status_.find(pg_id_) == fr_->all_pg_status_.end()) {
      fr_->all_pg_status_[pg_id_] = status_;
    }
    e.op_id_ = ++ops_;
    e.collective_seq_id_ = seq;
    e.p2p_seq_id_ = is_p2p ? ++p2p_ : p2p_;
    if (!is_p2p) {
      status_->lastEnqueuedSeq = int64_t(seq);
      status_->lastEnqueuedWorkName = e.profiling_name_;
    }
    e.id_ = fr_->id_;
    e.reset_epoch_ = fr_->reset_epoch_;
    // The ring: the next slot, overwriting the oldest entry once full (torch's record()).
    const size_t slot = fr_->next_++;
    if (fr_->entries_.size() < fr_->max_entries_) {
      fr_->entries_.emplace_back(std::move(e));
    } else {
      fr_->entries_[slot] = std::move(e);
    }
    if (fr_->next_ == fr_->max_entries_) fr_->next_ = 0;
    return FrTrace{fr_->id_++, fr_->reset_epoch_, true};
  }

  // The entry of `t` if the ring still holds it (torch's getIdxFromId); fr_->mutex_ held.
  TorchRecorder::Entry* find(const FrTrace& t) {
    const auto start = fr_->reset_epoch_start_idx_.find(t.epoch);
    if (start == fr_->reset_epoch_start_idx_.end() || fr_->max_entries_ == 0) return nullptr;
    const size_t idx = (start->second + t.id) % fr_->max_entries_;
    if (idx >= fr_->entries_.size()) return nullptr;
    TorchRecorder::Entry& e = fr_->entries_[idx];
    if (e.id_ != t.id || e.reset_epoch_ != t.epoch) return nullptr;
    return &e;
  }

  // Dumps on request, and once when a peer's header shows it failed (this rank may be in no
  // collective: the one that never called it).
  void monitor() {
    std::unique_lock<std::mutex> lock(mu_);
    bool peer_seen = false;
    while (!stopped_) {
      cv_.wait_for(lock, std::chrono::milliseconds(kPeerPollMs),
                   [&] { return stopped_ || requested_ > dumped_; });
      if (requested_ > dumped_) {
        const uint64_t ticket = requested_;
        const std::string why = reason_;
        lock.unlock();
        dump(why);
        lock.lock();
        dumped_ = ticket;
        peer_seen = true;  // this dump follows the group's own failure: enough
        done_cv_.notify_all();
        continue;
      }
      if (stopped_ || peer_seen || !aborted_peer_) continue;
      lock.unlock();
      int peer = -1;
      std::string message;
      const bool aborted = aborted_peer_(peer, message);
      if (aborted) dump("rank " + std::to_string(peer) + " of the group failed: " + message);
      lock.lock();
      peer_seen = aborted;
    }
  }

  // Writes torch's whole recorder (every group's entries, with stacks) where torch's
  // DebugInfoWriter says. One dump at a time in a process: they go to the same file.
  void dump(const std::string& why) {
    static std::mutex dumping;
    const std::lock_guard<std::mutex> held(dumping);
    if (!Py_IsInitialized()) return;
    try {
      const std::string trace = c10d::dump_fr_trace(/*includeCollectives=*/true,
                                                    /*includeStackTraces=*/true,
                                                    /*onlyActive=*/false);
      c10d::DebugInfoWriter& writer = c10d::DebugInfoWriter::getWriter(global_rank());
      writer.write(trace);
      std::cerr << "ringreduce: rank " << global_rank() << " wrote torch's flight recorder to "
                << writer.getWriterTarget() << " (" << why.substr(0, 300) << ")" << std::endl;
    } catch (const std::exception& e) {
      std::cerr << "ringreduce: rank " << global_rank() << " could not dump torch's flight "
                << "recorder: " << e.what() << std::endl;
    }
  }

  TorchRecorder* const fr_;
  const bool timing_;
  const bool dump_on_failure_;
  const size_t pg_id_;
  const std::vector<uint64_t> ranks_;
  const int rank_;
  const std::function<bool(int&, std::string&)> aborted_peer_;
  const std::shared_ptr<c10d::ProcessGroupStatus> status_;
  // Under fr_->mutex_:
  bool ranks_recorded_ = false;
  size_t ops_ = 0;  // op ids: every operation, collective or not
  size_t p2p_ = 0;  // p2p sequence numbers
  // The monitor:
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  uint64_t requested_ = 0, dumped_ = 0;
  std::string reason_;
  bool stopped_ = false;
  std::thread monitor_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
