// All-reduce (sum) and all-gather between the processes of one host, over a POSIX
// shared-memory segment, with no lock and no system call on the fast path.
//
// Why: gloo's all-reduce of a decode step's [16, 576] float32 takes 0.7-1.5 ms between two
// processes of one host (TCP loopback round trips); tensor parallelism needs two per layer.
// vLLM's CPU backend (csrc/cpu/shm.cpp) and SGLang do the same over shared memory.
//
// Layout: a header page (magic, size, capacity, each rank's pid and its sequence flag on a
// cache line of its own), then for each of two parities one `capacity`-byte slot per rank.
// A collective with sequence number s uses the parity s % 2:
//   1. rank r copies its part into its slot, then stores flag[r] = s (release);
//   2. it waits until every flag[j] >= s (acquire): all parts are in;
//   3. it reads the slots: the sum in rank order 0..n-1 (so every rank gets the same bits;
//      with two ranks, its own part plus its peer's, as exact), or the parts side by side
//      (all-gather).
// A rank writes slot parity p again only at s + 2, after waiting in s + 1 for every flag
// >= s + 1, and a peer sets its flag to s + 1 only after finishing step 3 of s: so no slot is
// overwritten while a peer still reads it, with one flag per rank and no second barrier.
// Tensors larger than a slot go through in slot-sized chunks, one sequence number each.
//
// Broadcast (the engine's schedule to the other ranks of a tensor-parallel group, instead of a
// pipe: a sleeping pipe reader wakes ~0.1 ms after the write here, a spinning one sees the flag
// within a microsecond): the root writes its slot and publishes s without waiting, the others
// wait for the root's flag, copy, and publish s. Since the root does not wait, every operation
// first waits until each flag is >= s - 1 (everyone has finished s - 2, the last use of this
// parity) before writing its slot; after a barrier that holds already, at the cost of a load
// per rank.
//
// Waiting spins (pause) for ~50 us, then yields the core (sched_yield): with more ranks than
// cores a spinning rank would otherwise hold the core its peer needs. While yielding it checks
// every ~100 ms that its peers are alive (kill(pid, 0), /proc state) and throws, naming the dead one,
// rather than hang.
#include <ATen/ATen.h>

#include "kernel_library.h"
#include "kernel_ops.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <stdexcept>
#include <string>
#include <vector>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

namespace {

constexpr uint64_t kMagic = 0x706c6c6d73686d31ULL;  // "pllmshm1"
constexpr int kMaxRanks = 32;
constexpr size_t kHeaderBytes = 4096;
constexpr int64_t kSpinNs = 50'000;
constexpr int64_t kLivenessCheckNs = 100'000'000;
// A broadcast's receivers wait for the engine's next schedule, i.e. through the engine's work
// between two steps (~0.3 ms at one sequence) or any idle time: they spin for kSpinNs, then
// yield the core until kHandOverYieldNs (a step's gap), then sleep, 50 us doubling to 1 ms, so
// that an idle group costs no core.
constexpr int64_t kHandOverYieldNs = 2'000'000;
constexpr int64_t kMaxSleepNs = 1'000'000;

struct alignas(64) Flag {
  std::atomic<uint64_t> seq;
};

struct Header {
  uint64_t magic;
  int32_t size;
  int32_t pad;
  int64_t capacity;  // bytes of one rank's slot
  int32_t pids[kMaxRanks];
  alignas(64) Flag flags[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeaderBytes, "header must fit its page");

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
}

struct Comm {
  std::string name;
  int rank = 0;
  int size = 0;
  int64_t capacity = 0;
  size_t bytes = 0;
  char* base = nullptr;
  uint64_t seq = 0;  // the last collective's number; the same on every rank

  Header* header() const { return reinterpret_cast<Header*>(base); }
  char* slot(uint64_t s, int r) const {
    return base + kHeaderBytes + ((s & 1) * size + r) * capacity;
  }

  // A killed process stays a zombie until its parent reaps it: kill(pid, 0) still succeeds.
  static bool is_gone(int pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    std::string path = "/proc/" + std::to_string(pid) + "/stat";
    FILE* file = std::fopen(path.c_str(), "r");
    if (file == nullptr) return false;
    char line[512];
    size_t n = std::fread(line, 1, sizeof(line) - 1, file);
    std::fclose(file);
    line[n] = 0;
    const char* paren = std::strrchr(line, ')');  // "pid (name) state ..."
    return paren != nullptr && (paren[2] == 'Z' || paren[2] == 'X');
  }

  void check_peers() const {
    for (int r = 0; r < size; ++r) {
      int pid = header()->pids[r];
      if (r != rank && pid > 0 && is_gone(pid)) {
        throw std::runtime_error("shared-memory all-reduce: tensor-parallel rank " +
                                 std::to_string(r) + " (pid " + std::to_string(pid) +
                                 ") is gone");
      }
    }
  }

  // Waits until rank r's flag is >= s: spins, then yields, then (with `may_sleep`) sleeps.
  void wait_for(int r, uint64_t s, bool may_sleep) const {
    int64_t start = now_ns(), last_check = start, sleep_ns = 50'000;
    uint32_t polls = 0;
    while (header()->flags[r].seq.load(std::memory_order_acquire) < s) {
      if ((++polls & 63) != 0) {
        _mm_pause();
        continue;
      }
      int64_t t = now_ns();
      if (t - start < kSpinNs) continue;
      if (may_sleep && t - start > kHandOverYieldNs) {
        timespec pause{0, sleep_ns};
        nanosleep(&pause, nullptr);
        sleep_ns = std::min(2 * sleep_ns, kMaxSleepNs);
      } else {
        sched_yield();
      }
      if (t - last_check > kLivenessCheckNs) {
        last_check = t;
        check_peers();
      }
    }
  }

  // Every rank has finished collective s - 2, the last one to use s's parity of the slots.
  void wait_until_slots_free(uint64_t s) const {
    if (s < 2) return;
    for (int r = 0; r < size; ++r) {
      if (r != rank) wait_for(r, s - 1, false);
    }
  }

  // Publishes this rank's part of collective s and waits for everyone's.
  void arrive_and_wait(uint64_t s) {
    header()->flags[rank].seq.store(s, std::memory_order_release);
    for (int r = 0; r < size; ++r) wait_for(r, s, false);
  }
  // Collective s: copies this rank's `bytes` into its slot once every peer is done with it,
  // then waits until all ranks' parts are in.
  void share(uint64_t s, const void* part, size_t bytes) {
    wait_until_slots_free(s);
    std::memcpy(slot(s, rank), part, bytes);
    arrive_and_wait(s);
  }
};

Comm* as_comm(int64_t handle) { return reinterpret_cast<Comm*>(handle); }

// out holds this rank's own part already. Two ranks: out += the peer's part (a + b == b + a
// bit for bit, so both ranks agree, and the own slot is never read back). More: the sum in
// rank order from the slots, identical on every rank.
void sum_float(float* __restrict out, const Comm& c, uint64_t s, int64_t n) {
  if (c.size == 2) {
    const float* __restrict peer = reinterpret_cast<const float*>(c.slot(s, 1 - c.rank));
    for (int64_t i = 0; i < n; ++i) out[i] += peer[i];
    return;
  }
  std::memcpy(out, c.slot(s, 0), n * sizeof(float));
  for (int r = 1; r < c.size; ++r) {
    const float* __restrict part = reinterpret_cast<const float*>(c.slot(s, r));
    for (int64_t i = 0; i < n; ++i) out[i] += part[i];
  }
}

// shm_all_gather_columns' copy of `rows` rows from the slots, for T of the elements' size.
template <typename T>
void pick_columns(const Comm& c, uint64_t s, int64_t width, const int64_t* index, int64_t picked,
                  int64_t rows, T* out) {
  std::vector<const T*> columns(picked);  // each picked column's first element in its slot
  for (int64_t j = 0; j < picked; ++j) {
    const int rank = static_cast<int>(index[j] / width);
    columns[j] = reinterpret_cast<const T*>(c.slot(s, rank)) + index[j] % width;
  }
  for (int64_t t = 0; t < rows; ++t) {
    T* row = out + t * picked;
    const int64_t offset = t * width;
    for (int64_t j = 0; j < picked; ++j) row[j] = columns[j][offset];
  }
}

}  // namespace

// The ops (kernel_ops.h): the Python side (pipellm/parallel/shm_comm.py, through
// pipellm/kernels/kernel_ops.py) and the fused decode path (decode_layers.cpp) call them.

int64_t pipellm_ops::shm_open_segment(const std::string& name, bool create, int64_t size,
                                      int64_t rank, int64_t capacity) {
  TORCH_CHECK(size > 1 && size <= kMaxRanks, "shm comm: size must be in [2, ", kMaxRanks, "]");
  TORCH_CHECK(rank >= 0 && rank < size, "shm comm: bad rank ", rank);
  TORCH_CHECK(capacity > 0 && capacity % 64 == 0, "shm comm: capacity must be a multiple of 64");
  size_t bytes = kHeaderBytes + 2 * size * capacity;
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm_open(", name, ") failed: ", std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int error = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "ftruncate(", name, ") failed: ", std::strerror(error));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int error = errno;
  close(fd);  // the mapping keeps the segment
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    TORCH_CHECK(false, "mmap(", name, ") failed: ", std::strerror(error));
  }
  auto* comm = new Comm();
  comm->name = name;
  comm->rank = static_cast<int>(rank);
  comm->size = static_cast<int>(size);
  comm->capacity = capacity;
  comm->bytes = bytes;
  comm->base = static_cast<char*>(base);
  Header* h = comm->header();
  if (create) {  // ftruncate zeroed it: flags start at 0
    h->size = static_cast<int32_t>(size);
    h->capacity = capacity;
    h->magic = kMagic;
  } else {
    TORCH_CHECK(h->magic == kMagic && h->size == size && h->capacity == capacity,
                "shm comm: segment ", name, " was made for another group");
  }
  h->pids[rank] = getpid();
  return reinterpret_cast<int64_t>(comm);
}

void pipellm_ops::shm_close_segment(int64_t handle) {
  Comm* comm = as_comm(handle);
  munmap(comm->base, comm->bytes);
  delete comm;
}

void pipellm_ops::shm_unlink_segment(const std::string& name) { shm_unlink(name.c_str()); }

// Sums x over the ranks, in place. Float32 takes the loop above; other dtypes add with ATen,
// in the same rank order.
void pipellm_ops::shm_all_reduce_(const at::Tensor& x, int64_t handle) {
  Comm& c = *as_comm(handle);
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "shm all_reduce_: a contiguous CPU tensor");
  const int64_t itemsize = x.element_size();
  const int64_t per_chunk = c.capacity / itemsize;
  const int64_t total = x.numel();
  char* data = static_cast<char*>(x.data_ptr());
  for (int64_t done = 0; done < total; done += per_chunk) {
    const int64_t n = std::min(per_chunk, total - done);
    const uint64_t s = ++c.seq;
    char* mine = data + done * itemsize;
    c.share(s, mine, n * itemsize);
    if (x.scalar_type() == at::kFloat) {
      sum_float(reinterpret_cast<float*>(mine), c, s, n);
      continue;
    }
    auto options = x.options();
    auto out = at::from_blob(mine, {n}, options);
    out.copy_(at::from_blob(c.slot(s, 0), {n}, options));
    for (int r = 1; r < c.size; ++r) out.add_(at::from_blob(c.slot(s, r), {n}, options));
  }
}

// out[r] = rank r's x, for out of shape [size, *x.shape].
void pipellm_ops::shm_all_gather(const at::Tensor& x, const at::Tensor& out, int64_t handle) {
  Comm& c = *as_comm(handle);
  TORCH_CHECK(x.is_cpu() && x.is_contiguous() && out.is_contiguous(),
              "shm all_gather: contiguous CPU tensors");
  TORCH_CHECK(out.numel() == x.numel() * c.size && out.dtype() == x.dtype(),
              "shm all_gather: out must hold size x the input");
  const int64_t itemsize = x.element_size();
  const int64_t total = x.numel() * itemsize;
  const char* data = static_cast<const char*>(x.data_ptr());
  char* dest = static_cast<char*>(out.data_ptr());
  for (int64_t done = 0; done < total; done += c.capacity) {
    const int64_t n = std::min(c.capacity, total - done);
    const uint64_t s = ++c.seq;
    c.share(s, data + done, n);
    for (int r = 0; r < c.size; ++r) std::memcpy(dest + r * total + done, c.slot(s, r), n);
  }
}

// out[t, j] = element index[j] of row t of the ranks' x side by side (rank r's x [T, W] at
// columns r * W ...): an all-gather that writes only the columns this rank wants, straight
// from the slots, in one call. Tensor parallelism's q/k/v rows of heads that straddle ranks
// (model/tp_plan.py): no gathered copy, permute or index_select on the way (their time was
// not measured apart). Rows go through in chunks that fit a slot.
void pipellm_ops::shm_all_gather_columns(const at::Tensor& x, const at::Tensor& index,
                                         const at::Tensor& out, int64_t handle) {
  Comm& c = *as_comm(handle);
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.is_contiguous() && out.is_contiguous() &&
                  index.is_contiguous() && index.scalar_type() == at::kLong,
              "shm all_gather_columns: contiguous CPU x [T, W], out [T, J], int64 index [J]");
  const int64_t rows = x.size(0), width = x.size(1), picked = index.numel();
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == picked &&
                  out.dtype() == x.dtype(),
              "shm all_gather_columns: out must be [T, len(index)] of x's dtype");
  TORCH_CHECK(x.element_size() == 4 || x.element_size() == 2,
              "shm all_gather_columns: 2- or 4-byte elements");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t j = 0; j < picked; ++j)
    TORCH_CHECK(idx[j] >= 0 && idx[j] < c.size * width, "shm all_gather_columns: bad index");
  const int64_t row_bytes = width * x.element_size();
  TORCH_CHECK(row_bytes <= c.capacity, "shm all_gather_columns: a row exceeds a slot");
  const int64_t rows_per_chunk = c.capacity / row_bytes;
  const char* data = static_cast<const char*>(x.data_ptr());
  char* dest = static_cast<char*>(out.data_ptr());
  for (int64_t done = 0; done < rows; done += rows_per_chunk) {
    const int64_t n = std::min(rows_per_chunk, rows - done);
    const uint64_t s = ++c.seq;
    c.share(s, data + done * row_bytes, n * row_bytes);
    if (x.element_size() == 4) {
      pick_columns(c, s, width, idx, picked, n,
                   reinterpret_cast<float*>(dest) + done * picked);
    } else {
      pick_columns(c, s, width, idx, picked, n,
                   reinterpret_cast<uint16_t*>(dest) + done * picked);
    }
  }
}

// Rank `root` sends `data` (uint8) to every other rank (which calls broadcast_recv). The root
// does not wait for them: its next operation does, before it writes over the slot they read.
// Each chunk starts with the whole message's length.
void pipellm_ops::shm_broadcast_send(const at::Tensor& data, int64_t handle) {
  Comm& c = *as_comm(handle);
  TORCH_CHECK(data.is_cpu() && data.scalar_type() == at::kByte && data.dim() == 1 &&
                  data.is_contiguous(),
              "shm broadcast_send: a contiguous 1-D uint8 CPU tensor");
  const int64_t room = c.capacity - static_cast<int64_t>(sizeof(int64_t));
  const int64_t total = data.numel();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  int64_t done = 0;
  do {
    const int64_t n = std::min(room, total - done);
    const uint64_t s = ++c.seq;
    c.wait_until_slots_free(s);
    char* slot = c.slot(s, c.rank);
    std::memcpy(slot, &total, sizeof(total));
    std::memcpy(slot + sizeof(total), bytes + done, n);
    c.header()->flags[c.rank].seq.store(s, std::memory_order_release);
    done += n;
  } while (done < total);
}

// Receives rank `root`'s broadcast_send, as uint8. Waiting through idle time sleeps
// (Comm::wait_for), and a root that died is named rather than waited for.
at::Tensor pipellm_ops::shm_broadcast_recv(int64_t handle, int64_t root) {
  Comm& c = *as_comm(handle);
  at::Tensor data;
  int64_t total = 0, done = 0;
  do {
    const uint64_t s = ++c.seq;
    c.wait_for(static_cast<int>(root), s, true);
    const char* slot = c.slot(s, static_cast<int>(root));
    std::memcpy(&total, slot, sizeof(total));
    if (done == 0) data = at::empty({total}, at::TensorOptions().dtype(at::kByte));
    const int64_t n = std::min(c.capacity - static_cast<int64_t>(sizeof(total)), total - done);
    std::memcpy(data.data_ptr<uint8_t>() + done, slot + sizeof(total), n);
    c.header()->flags[c.rank].seq.store(s, std::memory_order_release);
    done += n;
  } while (done < total);
  return data;
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("shm_open_segment(str name, bool create, int size, int rank, int capacity) -> int",
        &pipellm_ops::shm_open_segment);
  m.def("shm_close_segment(int handle) -> ()", &pipellm_ops::shm_close_segment);
  m.def("shm_unlink_segment(str name) -> ()", &pipellm_ops::shm_unlink_segment);
  m.def("shm_all_reduce_(Tensor(a!) x, int handle) -> ()", &pipellm_ops::shm_all_reduce_);
  m.def("shm_all_gather(Tensor x, Tensor(a!) out, int handle) -> ()",
        &pipellm_ops::shm_all_gather);
  m.def("shm_all_gather_columns(Tensor x, Tensor index, Tensor(a!) out, int handle) -> ()",
        &pipellm_ops::shm_all_gather_columns);
  m.def("shm_broadcast_send(Tensor data, int handle) -> ()", &pipellm_ops::shm_broadcast_send);
  m.def("shm_broadcast_recv(int handle, int root) -> Tensor", &pipellm_ops::shm_broadcast_recv);
}
