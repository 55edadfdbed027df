// Collectives over POSIX shared memory for the ranks of one machine (kernels/shm_comm.py wraps
// this class and states the contract): in-place sum all-reduce, all-gather, gather, barrier.
//
// Segment "/dev/shm/rollout-shm-<name>": a Header, one RankCtl cache line per rank, then per
// rank two slots of slot_bytes (one per round parity). A call moves its tensor in rounds of at
// most slot_bytes; in round n every rank
//   1. copies its piece into its slot[n % 2],
//   2. publishes seq = n (release store; a peer's acquire load of seq >= n sees the piece),
//   3. waits until every peer's seq >= n (the round's one barrier),
//   4. reads the peers' slot[n % 2] (sum, copy out).
// Why one barrier per round is enough: a rank writes slot[n % 2] again in round n + 2, and it
// only starts round n + 2 after step 3 of round n + 1, i.e. after every peer has published
// n + 1, which each peer does only after finishing step 4 of round n. So a writer is at most
// one round ahead of any reader, and that round uses the other slot.
//
// Every rank sums all ranks' pieces in rank order 0..N-1 in float32 (bf16: widened, rounded
// once at the end like c10::BFloat16), so every rank computes the same bits. Each round also
// publishes a tag (op, dtype, total bytes, gather's dst): ranks that disagree about which
// collective they are in raise instead of mixing unrelated data.
//
// Waiting spins with a pause instruction for kSpinS, then sched_yield()s until kYieldS, then
// sleeps kSleepUs at a time. Every kPeerCheckS a waiter checks the ranks it waits for: a pid
// that is gone (kill(pid, 0)), a zombie, or a reused pid (another start time in /proc) means
// that rank died; pid 0 after the join means it closed. Those, the overall timeout and a peer
// that broke the group (Header::broken) raise std::runtime_error (RuntimeError in Python), and
// the communicator refuses every later call: the ranks' round counters no longer agree. The
// first rank to fail writes its reason into the Header, so the peers' errors name the cause.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "ops.h"

namespace rollout_shm {
namespace {

constexpr uint64_t kMagic = 0x31766d68736c6c72ULL;  // "rllshmv1": bump when the layout changes
constexpr int64_t kMaxRanks = 64;
constexpr int64_t kPage = 4096;
constexpr double kSpinS = 50e-6, kYieldS = 2e-3, kPeerCheckS = 0.1;
constexpr int kSleepUs = 20;
constexpr int64_t kBlock = 256;  // > 4 ranks: elements summed per pass in an L1 buffer

enum Op : uint64_t { kBarrier = 1, kAllReduce = 2, kAllGather = 3, kGather = 4 };
const char* const kOpNames[] = {"?", "barrier", "all_reduce_", "all_gather", "gather"};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "the counters are shared between processes: they must be plain lock-free words");

struct alignas(64) Header {
  std::atomic<uint64_t> magic;  // stored last by the creator (release): the fields below are set
  int64_t world_size;
  int64_t slot_bytes;
  std::atomic<int64_t> broken;  // 0; -1 while `reason` is written; then 1 + the failing rank
  std::atomic<int64_t> num_attached;
  char reason[256];  // the failing rank's error, for the peers' messages
};

struct alignas(64) RankCtl {  // written only by its rank, read by every peer
  std::atomic<uint64_t> seq;     // the last round this rank has published
  std::atomic<uint64_t> tag[2];  // the tag of its last round of each parity
  std::atomic<int64_t> pid;      // 0 before it attaches and after it closes
  std::atomic<uint64_t> start_time;  // /proc/<pid>/stat field 22: tells a reused pid apart
};

// bits: total bytes 0-39, dtype 40-47, op 48-55, gather's dst 56-63
uint64_t make_tag(Op op, int64_t dtype, int64_t nbytes, int64_t dst) {
  return (uint64_t)nbytes | (uint64_t)dtype << 40 | (uint64_t)op << 48 | (uint64_t)dst << 56;
}

std::string describe_tag(uint64_t tag) {
  const uint64_t op = (tag >> 48) & 0xFF;
  std::string s = op <= kGather ? kOpNames[op] : "?";
  if (op == kBarrier) return s;
  s += "(" + std::string(c10::toString((at::ScalarType)((tag >> 40) & 0xFF))) + ", " +
       std::to_string(tag & ((1ULL << 40) - 1)) + " bytes";
  if (op == kGather) s += ", dst " + std::to_string(tag >> 56);
  return s + ")";
}

[[noreturn]] void raise(const std::string& msg) { throw std::runtime_error(msg); }

std::string errno_text() { return std::strerror(errno); }

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// State (field 3) and start time (field 22) of a process from /proc/<pid>/stat; false when
// there is no such file.
bool read_proc_stat(int64_t pid, char* state, uint64_t* start_time) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name (field 2) may hold spaces
  if (!p || p[1] != ' ') return false;
  p += 2;
  *state = *p;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return false;
    ++p;
  }
  *start_time = std::strtoull(p, nullptr, 10);
  return true;
}

uint64_t own_start_time() {
  char state;
  uint64_t start_time = 0;
  return read_proc_stat(getpid(), &state, &start_time) ? start_time : 0;
}

// A SIGKILLed process stays a zombie until its parent reaps it, and kill(pid, 0) succeeds on a
// zombie: /proc tells it apart (and a pid reused by a newer process, by its start time).
bool process_alive(int64_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return false;
  char state;
  uint64_t started;
  if (!read_proc_stat(pid, &state, &started)) return access("/proc/self/stat", R_OK) != 0;
  return state != 'Z' && state != 'X' && (start_time == 0 || started == start_time);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t h) {  // bf16 bits -> float32, exact
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {  // round to nearest even, NaN -> 0x7FC0 (c10's rule)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *out = x != x ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... in float32, rounded to T once.
// One pass over memory for up to 4 ranks (the rank loop unrolls); blocks of kBlock otherwise.
template <typename T, int N>
void sum_fixed(const char* const* src, T* out, int64_t n) {
  const T* s[N];
  for (int r = 0; r < N; ++r) s[r] = reinterpret_cast<const T*>(src[r]);
  for (int64_t i = 0; i < n; ++i) {
    float acc = widen(s[0][i]);
#pragma GCC unroll 4
    for (int r = 1; r < N; ++r) acc += widen(s[r][i]);
    narrow(acc, out + i);
  }
}

template <typename T>
void sum_in_rank_order(const char* const* src, int64_t num_ranks, T* out, int64_t n) {
  switch (num_ranks) {
    case 1: return sum_fixed<T, 1>(src, out, n);
    case 2: return sum_fixed<T, 2>(src, out, n);
    case 3: return sum_fixed<T, 3>(src, out, n);
    case 4: return sum_fixed<T, 4>(src, out, n);
  }
  float acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    const T* s0 = reinterpret_cast<const T*>(src[0]) + i0;
    for (int64_t j = 0; j < m; ++j) acc[j] = widen(s0[j]);
    for (int64_t r = 1; r < num_ranks; ++r) {
      const T* s = reinterpret_cast<const T*>(src[r]) + i0;
      for (int64_t j = 0; j < m; ++j) acc[j] += widen(s[j]);
    }
    for (int64_t j = 0; j < m; ++j) narrow(acc[j], out + i0 + j);
  }
}

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor is needed, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, ": the tensor must be contiguous");
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct ShmComm::Impl {
  std::string name, shm_name;
  int64_t rank, world_size, slot_bytes;
  double timeout_s;
  int64_t slots_offset = 0, size = 0;
  char* base = nullptr;
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t rounds_done = 0;
  pid_t owner = getpid();
  bool joined = false, closed = false;
  std::string broken;  // why this communicator refuses calls; empty while usable

  Impl(const std::string& name_, int64_t rank_, int64_t world_size_, int64_t slot_bytes_,
       double timeout_s_)
      : name(name_), shm_name("/rollout-shm-" + name_), rank(rank_), world_size(world_size_),
        slot_bytes(slot_bytes_), timeout_s(timeout_s_) {
    TORCH_CHECK(!name.empty() && name.size() <= 200 && name.find('/') == std::string::npos,
                "ShmComm: name must be 1-200 characters without '/', got '", name, "'");
    TORCH_CHECK(world_size >= 1 && world_size <= kMaxRanks, "ShmComm: world_size must be in [1, ",
                kMaxRanks, "], got ", world_size);
    TORCH_CHECK(rank >= 0 && rank < world_size, "ShmComm: rank ", rank, " is outside world_size ",
                world_size);
    TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0 && slot_bytes < (1LL << 36),
                "ShmComm: slot_bytes must be a positive multiple of 64, got ", slot_bytes);
    TORCH_CHECK(timeout_s > 0, "ShmComm: timeout_s must be positive, got ", timeout_s);
    slots_offset = (int64_t)(sizeof(Header) + world_size * sizeof(RankCtl) + kPage - 1) / kPage * kPage;
    size = slots_offset + 2 * world_size * slot_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    if (rank == 0) {
      create();
    } else {
      while (!try_attach()) {
        if (seconds_since(t0) > timeout_s)
          raise(where() + "timed out after " + seconds(timeout_s) + " waiting for rank 0 to create the segment");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  ~Impl() { close(); }

  std::string where() const { return "ShmComm '" + name + "' rank " + std::to_string(rank) + ": "; }
  Header* header() const { return reinterpret_cast<Header*>(base); }
  RankCtl* ctl(int64_t r) const { return reinterpret_cast<RankCtl*>(base + sizeof(Header)) + r; }
  char* slot(int64_t r, uint64_t parity) const {
    return base + slots_offset + (2 * r + (int64_t)parity) * slot_bytes;
  }

  // Maps the whole open segment; closes fd either way.
  char* map(int fd, int64_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const std::string err = p == MAP_FAILED ? errno_text() : "";
    struct stat st;
    if (p != MAP_FAILED && fstat(fd, &st) == 0) dev = st.st_dev, ino = st.st_ino;
    ::close(fd);
    if (p == MAP_FAILED) raise(where() + "mmap of " + shm_name + " failed: " + err);
    return static_cast<char*>(p);
  }

  // A segment left by an earlier group of this name (its processes died, or never closed it) is
  // replaced, unless its rank 0 is another live process: then the name is taken.
  void create() {
    int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
    if (fd >= 0) {
      struct stat st;
      if (fstat(fd, &st) == 0 && st.st_size >= (off_t)(sizeof(Header) + sizeof(RankCtl))) {
        void* p = mmap(nullptr, sizeof(Header) + sizeof(RankCtl), PROT_READ, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          const auto* h = static_cast<const Header*>(p);
          const auto* c = reinterpret_cast<const RankCtl*>(h + 1);
          const int64_t pid = c->pid.load();
          const bool taken = h->magic.load() == kMagic && pid != getpid() &&
                             process_alive(pid, c->start_time.load());
          munmap(p, sizeof(Header) + sizeof(RankCtl));
          if (taken) {
            ::close(fd);
            raise(where() + shm_name + " is in use by a live rank 0 (pid " + std::to_string(pid) +
                  "): pick another name");
          }
        }
      }
      ::close(fd);
      shm_unlink(shm_name.c_str());
    }
    fd = shm_open(shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) raise(where() + "cannot create " + shm_name + ": " + errno_text());
    // posix_fallocate reserves the pages: a full /dev/shm fails here, not with SIGBUS later.
    if (const int err = posix_fallocate(fd, 0, size)) {
      ::close(fd);
      shm_unlink(shm_name.c_str());
      raise(where() + "cannot reserve " + std::to_string(size) + " bytes for " + shm_name +
            " in /dev/shm: " + std::strerror(err));
    }
    try {
      base = map(fd, size);
    } catch (...) {
      shm_unlink(shm_name.c_str());
      throw;
    }
    header()->world_size = world_size;
    header()->slot_bytes = slot_bytes;
    header()->num_attached.store(1);
    ctl(0)->start_time.store(own_start_time());
    ctl(0)->pid.store(getpid());
    header()->magic.store(kMagic, std::memory_order_release);
  }

  // One look at the segment: true once attached as `rank`; false while there is no live
  // segment to join (not created yet, being initialized, or left by a dead group).
  bool try_attach() {
    const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      if (errno == ENOENT) return false;
      raise(where() + "cannot open " + shm_name + ": " + errno_text());
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < slots_offset) {  // rank 0 is between open and fallocate
      ::close(fd);
      return false;
    }
    const int64_t bytes = st.st_size;
    base = map(fd, bytes);
    const auto give_up = [&](bool retry, const std::string& msg) {
      munmap(base, bytes);
      base = nullptr;
      if (!retry) raise(where() + msg);
      return false;
    };
    if (header()->magic.load(std::memory_order_acquire) != kMagic) return give_up(true, "");
    if (!process_alive(ctl(0)->pid.load(), ctl(0)->start_time.load())) return give_up(true, "");
    if (header()->world_size != world_size || header()->slot_bytes != slot_bytes || bytes != size)
      return give_up(false, shm_name + " was created for world_size " +
                                std::to_string(header()->world_size) + ", slot_bytes " +
                                std::to_string(header()->slot_bytes) + "; this rank asks for " +
                                std::to_string(world_size) + ", " + std::to_string(slot_bytes));
    if (header()->broken.load() != 0) return give_up(true, "");  // rank 0 will replace it
    RankCtl* me = ctl(rank);
    const uint64_t old_start = me->start_time.load();
    me->start_time.store(own_start_time());
    int64_t holder = 0;
    if (!me->pid.compare_exchange_strong(holder, getpid())) {
      me->start_time.store(old_start);
      if (process_alive(holder, old_start))
        return give_up(false, "rank " + std::to_string(rank) + " of " + shm_name +
                                  " is already attached by pid " + std::to_string(holder));
      return give_up(true, "");  // a joiner of a group that failed to form
    }
    header()->num_attached.fetch_add(1);
    return true;
  }

  // Marks this communicator and the group broken (the first failing rank's reason is what the
  // peers report), then raises.
  [[noreturn]] void fail(const std::string& msg) {
    broken = msg;
    int64_t none = 0;
    if (base && header()->broken.compare_exchange_strong(none, -1)) {
      std::snprintf(header()->reason, sizeof header()->reason, "%s", msg.c_str());
      header()->broken.store(rank + 1, std::memory_order_release);
    }
    raise(where() + msg);
  }

  void check_usable(const char* what) const {
    if (closed) raise(where() + what + " on a closed communicator");
    if (!broken.empty())
      raise(where() + what + " on a broken communicator (earlier error: " + broken +
            "); close it and open a new one");
  }

  // Raises if a rank this one waits for (seq < n) died or closed.
  void check_peers(uint64_t n, const char* what) {
    for (int64_t q = 0; q < world_size; ++q) {
      if (q == rank || ctl(q)->seq.load(std::memory_order_acquire) >= n) continue;
      const int64_t pid = ctl(q)->pid.load();
      if (pid == 0) {
        if (joined) fail(std::string(what) + ": rank " + std::to_string(q) + " closed the communicator");
        continue;  // not attached yet: only the timeout applies
      }
      if (!process_alive(pid, ctl(q)->start_time.load()))
        fail(std::string(what) + ": rank " + std::to_string(q) + " (pid " + std::to_string(pid) +
             ") died");
    }
  }

  void wait_all(uint64_t n, const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    double next_check = kPeerCheckS;
    int64_t q = 0;  // peers below q have published n: seq only grows
    for (uint64_t spins = 0;; ++spins) {
      while (q < world_size && (q == rank || ctl(q)->seq.load(std::memory_order_acquire) >= n)) ++q;
      if (q == world_size) return;
      if (spins % 64 != 63) {  // the clock costs more than a pause
        cpu_pause();
        continue;
      }
      const double waited = seconds_since(t0);
      if (waited < kSpinS) continue;
      if (waited < kYieldS) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(kSleepUs));
      const int64_t by = header()->broken.load(std::memory_order_acquire);
      if (by > 0 && by != rank + 1)
        fail(std::string(what) + ": rank " + std::to_string(by - 1) + " broke the group (" +
             std::string(header()->reason, strnlen(header()->reason, sizeof header()->reason)) + ")");
      if (waited >= next_check) {
        next_check = waited + kPeerCheckS;
        check_peers(n, what);
      }
      if (waited >= timeout_s)
        fail(std::string(what) + ": timed out after " + seconds(timeout_s) + " waiting for rank " + std::to_string(q));
    }
  }

  // Runs the rounds of one collective: `consume(parity, offset, length)` reads the peers'
  // pieces of src[offset, offset + length) from their slot[parity]. At least one round, so that
  // even an empty tensor synchronizes and checks the tags.
  template <typename F>
  void rounds(uint64_t tag, const char* src, int64_t nbytes, const char* what, F&& consume) {
    int64_t off = 0;
    do {
      const int64_t len = std::min(slot_bytes, nbytes - off);
      const uint64_t n = ++rounds_done, parity = n & 1;
      if (len > 0) std::memcpy(slot(rank, parity), src + off, len);
      ctl(rank)->tag[parity].store(tag, std::memory_order_relaxed);
      ctl(rank)->seq.store(n, std::memory_order_release);
      wait_all(n, what);
      for (int64_t q = 0; q < world_size; ++q) {
        const uint64_t theirs = ctl(q)->tag[parity].load(std::memory_order_relaxed);
        if (theirs != tag)
          fail("collective mismatch: this rank called " + describe_tag(tag) + ", rank " +
               std::to_string(q) + " called " + describe_tag(theirs));
      }
      consume(parity, off, len);
      off += len;
    } while (off < nbytes);
  }

  void join() {
    rounds(make_tag(kBarrier, 0, 0, 0), nullptr, 0, "joining", [](uint64_t, int64_t, int64_t) {});
    joined = true;
  }

  // The ranks' tensors one after another along dim 0: on every rank (dst < 0) or on dst only.
  std::optional<at::Tensor> gather(const at::Tensor& t, int64_t dst, const char* what) {
    check_tensor(t, what);
    TORCH_CHECK(t.dim() >= 1, what, ": a tensor with at least one dimension is needed");
    check_usable(what);
    const bool all = dst < 0;
    std::optional<at::Tensor> out;
    char* o = nullptr;
    if (all || rank == dst) {
      auto sizes = t.sizes().vec();
      sizes[0] *= world_size;
      out = at::empty(sizes, t.options());
      o = static_cast<char*>(out->data_ptr());
    }
    const char* src = static_cast<const char*>(t.data_ptr());
    const int64_t nbytes = t.nbytes();
    const uint64_t tag = make_tag(all ? kAllGather : kGather, (int64_t)t.scalar_type(), nbytes, all ? 0 : dst);
    rounds(tag, src, nbytes, what, [&](uint64_t parity, int64_t off, int64_t len) {
      if (!o || len == 0) return;
      for (int64_t q = 0; q < world_size; ++q)
        std::memcpy(o + q * nbytes + off, q == rank ? src + off : slot(q, parity), len);
    });
    return out;
  }

  void close() {
    if (closed || !base) {
      closed = true;
      return;
    }
    closed = true;
    if (getpid() != owner) {  // a fork()ed child's copy: the rank is still its parent's
      munmap(base, size);
      base = nullptr;
      return;
    }
    ctl(rank)->pid.store(0, std::memory_order_release);
    const bool last = header()->num_attached.fetch_sub(1) == 1;
    if (rank == 0 || last) {  // unlink only our segment, not a newer one of the same name
      const int fd = shm_open(shm_name.c_str(), O_RDONLY, 0);
      struct stat st;
      if (fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino)
        shm_unlink(shm_name.c_str());
      if (fd >= 0) ::close(fd);
    }
    munmap(base, size);
    base = nullptr;
  }
};

ShmComm::ShmComm(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
                 double timeout_s)
    : impl_(std::make_unique<Impl>(name, rank, world_size, slot_bytes, timeout_s)) {
  try {
    impl_->join();
  } catch (...) {
    impl_->close();
    throw;
  }
}

ShmComm::~ShmComm() = default;

void ShmComm::all_reduce_(const at::Tensor& t) {
  check_tensor(t, "all_reduce_");
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "all_reduce_: float32 or bfloat16 tensors only, got ", dtype);
  Impl& c = *impl_;
  c.check_usable("all_reduce_");
  char* data = static_cast<char*>(t.data_ptr());
  const int64_t elem = t.element_size();
  std::array<const char*, kMaxRanks> src;
  c.rounds(make_tag(kAllReduce, (int64_t)dtype, t.nbytes(), 0), data, t.nbytes(), "all_reduce_",
           [&](uint64_t parity, int64_t off, int64_t len) {
             for (int64_t q = 0; q < c.world_size; ++q) src[q] = c.slot(q, parity);
             if (dtype == at::kFloat)
               sum_in_rank_order(src.data(), c.world_size, reinterpret_cast<float*>(data + off), len / elem);
             else
               sum_in_rank_order(src.data(), c.world_size, reinterpret_cast<uint16_t*>(data + off), len / elem);
           });
}

at::Tensor ShmComm::all_gather(const at::Tensor& t) { return *impl_->gather(t, -1, "all_gather"); }

std::optional<at::Tensor> ShmComm::gather(const at::Tensor& t, int64_t dst) {
  TORCH_CHECK(dst >= 0 && dst < impl_->world_size, "gather: dst ", dst, " is outside world_size ",
              impl_->world_size);
  return impl_->gather(t, dst, "gather");
}

void ShmComm::barrier() {
  impl_->check_usable("barrier");
  impl_->rounds(make_tag(kBarrier, 0, 0, 0), nullptr, 0, "barrier", [](uint64_t, int64_t, int64_t) {});
}

void ShmComm::close() { impl_->close(); }

std::string ShmComm::segment_name() const { return impl_->shm_name; }

}  // namespace rollout_shm
