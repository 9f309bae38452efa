// Caching allocator, one per device: segments (memfds) are carved into 512-byte-aligned blocks;
// freed blocks are merged with free neighbours and kept for reuse until orEmptyCache.
//
// Pools as in CUDA's allocator: requests up to 1 MiB come from 2 MiB "small" segments; larger
// ones get a segment of their own rounded up to 2 MiB, whose free remainder serves other large
// requests. A block never spans two segments, so a segment is an IPC unit on its own.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "internal.h"

namespace {

using openreg::fail;

constexpr size_t kBlockAlign = 512;
constexpr size_t kSmallLimit = 1 << 20;    // requests up to this size use small segments
constexpr size_t kSegmentAlign = 2 << 20;  // every segment is a multiple of this

struct Segment;
struct Block {
  uintptr_t ptr;
  size_t size;
  Segment* segment;
  Block* prev;  // address-ordered neighbours inside the segment
  Block* next;
  bool allocated;
};

struct Segment {
  openreg::SharedFile file;
  bool small;
  Block* first;
};

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};

// Invariant (under `mutex`): every block of every segment is either in `live` (allocated) or in
// the free pool of its segment kind; adjacent free blocks of a segment are always merged.
struct DeviceAllocator {
  int device = 0;
  std::mutex mutex;
  std::set<Block*, BySize> freeSmall, freeLarge;
  std::unordered_map<uintptr_t, Block*> live;
  std::vector<Segment*> segments;
  orMemStats stats{};

  std::set<Block*, BySize>& pool(bool small) {
    return small ? freeSmall : freeLarge;
  }

  orError_t allocate(size_t request, void** out) {
    // Rounding a size this close to SIZE_MAX would wrap to a tiny (even 0-byte) block.
    if (request > SIZE_MAX - kSegmentAlign)
      return fail(orErrorMemoryAllocation, "orMalloc: device %d cannot allocate %zu bytes", device,
                  request);
    size_t size = (request + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
    bool small = size <= kSmallLimit;
    std::lock_guard<std::mutex> lock(mutex);
    Block key{0, size, nullptr, nullptr, nullptr, false};
    auto& free = pool(small);
    auto it = free.lower_bound(&key);
    Block* block = nullptr;
    if (it != free.end()) {
      block = *it;
      free.erase(it);
    } else {
      size_t segmentSize =
          small ? kSegmentAlign : (size + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign;
      if (orError_t err = newSegment(segmentSize, small, &block)) return err;
    }
    // Keep the remainder if it can serve a request of the same pool.
    size_t rest = block->size - size;
    if (small ? rest >= kBlockAlign : rest > kSmallLimit) {
      Block* tail = new Block{block->ptr + size, rest, block->segment, block, block->next, false};
      if (block->next) block->next->prev = tail;
      block->next = tail;
      block->size = size;
      free.insert(tail);
    }
    block->allocated = true;
    live[block->ptr] = block;
    stats.allocated += block->size;
    stats.peak_allocated = std::max(stats.peak_allocated, stats.allocated);
    stats.num_allocs++;
    *out = (void*)block->ptr;
    return orSuccess;
  }

  orError_t newSegment(size_t size, bool small, Block** out) {
    char tag[16];
    snprintf(tag, sizeof(tag), "%d", openreg::physicalIndex(device));
    Segment* segment = new Segment{};
    if (orError_t err = openreg::createSharedFile("orMalloc", tag, size, &segment->file)) {
      delete segment;
      std::string cause = orGetLastErrorMessage();
      return fail(err,
                  "orMalloc: device %d cannot reserve %zu more bytes (%llu reserved, %llu in "
                  "use; orEmptyCache releases cached segments). Cause: %s",
                  device, size, (unsigned long long)stats.reserved,
                  (unsigned long long)stats.allocated, cause.c_str());
    }
    segment->small = small;
    segment->first =
        new Block{(uintptr_t)segment->file.base, size, segment, nullptr, nullptr, false};
    segments.push_back(segment);
    openreg::Region region;
    region.base = (uintptr_t)segment->file.base;
    region.size = size;
    region.device = device;
    region.physical = openreg::physicalIndex(device);
    region.pid = getpid();
    region.fd = segment->file.fd;
    std::copy(segment->file.token, segment->file.token + openreg::kTokenSize, region.token);
    openreg::registerRegion(region);
    stats.reserved += size;
    stats.peak_reserved = std::max(stats.peak_reserved, stats.reserved);
    stats.num_segments++;
    *out = segment->first;
    return orSuccess;
  }

  // Returns false if ptr is not a live block of this device.
  bool release(uintptr_t ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = live.find(ptr);
    if (it == live.end()) return false;
    Block* block = it->second;
    live.erase(it);
    stats.allocated -= block->size;
    stats.num_frees++;
    block->allocated = false;
    auto& free = pool(block->segment->small);
    if (Block* next = block->next; next && !next->allocated) {
      free.erase(next);
      absorb(block, next);
    }
    if (Block* prev = block->prev; prev && !prev->allocated) {
      free.erase(prev);
      absorb(prev, block);
      block = prev;
    }
    free.insert(block);
    return true;
  }

  // `left` takes over its right neighbour `right`, which is deleted.
  static void absorb(Block* left, Block* right) {
    left->size += right->size;
    left->next = right->next;
    if (right->next) right->next->prev = left;
    delete right;
  }

  void emptyCache() {
    std::lock_guard<std::mutex> lock(mutex);
    auto unused = [&](Segment* s) {
      Block* b = s->first;
      if (b->allocated || b->next) return false;
      pool(s->small).erase(b);
      openreg::unregisterRegion((uintptr_t)s->file.base);
      munmap(s->file.base, s->file.size);
      close(s->file.fd);
      stats.reserved -= s->file.size;
      stats.num_segments--;
      delete b;
      delete s;
      return true;
    };
    segments.erase(std::remove_if(segments.begin(), segments.end(), unused), segments.end());
  }
};

DeviceAllocator& allocator(int device) {
  static std::vector<DeviceAllocator*>* all = [] {
    auto* v = new std::vector<DeviceAllocator*>();
    for (int i = 0; i < openreg::deviceCount(); i++) {
      v->push_back(new DeviceAllocator());
      v->back()->device = i;
    }
    return v;
  }();
  return *(*all)[device];
}

// Pinned host blocks by base address (so interior pointers resolve), aligned as torch's CPU memory.
constexpr size_t kHostAlign = 64;
struct HostBlocks {
  std::mutex mutex;
  std::map<uintptr_t, size_t> blocks;
};

HostBlocks& hostBlocks() {
  static HostBlocks* h = new HostBlocks();
  return *h;
}

// MemAvailable of /proc/meminfo (what can be allocated without swapping), in bytes; 0 if unknown.
size_t availableHostMemory() {
  FILE* f = fopen("/proc/meminfo", "re");
  if (!f) return 0;
  char line[256];
  unsigned long long kib = 0;
  const char field[] = "MemAvailable:";
  while (fgets(line, sizeof(line), f))
    if (strncmp(line, field, sizeof(field) - 1) == 0) {
      kib = strtoull(line + sizeof(field) - 1, nullptr, 10);  // leading blanks skipped, then kB
      break;
    }
  fclose(f);
  return (size_t)kib * 1024;
}

}  // namespace

namespace openreg {

bool findHostBlock(const void* ptr, uintptr_t* base, size_t* size) {
  HostBlocks& h = hostBlocks();
  std::lock_guard<std::mutex> lock(h.mutex);
  auto it = h.blocks.upper_bound((uintptr_t)ptr);
  if (it == h.blocks.begin()) return false;
  --it;
  if ((uintptr_t)ptr >= it->first + it->second) return false;
  *base = it->first;
  *size = it->second;
  return true;
}

}  // namespace openreg

using openreg::checkDevice;

extern "C" {

orError_t orMalloc(void** ptr, size_t size) {
  if (!ptr) return fail(orErrorInvalidValue, "orMalloc: ptr is NULL");
  int device = openreg::currentDevice();
  if (orError_t err = checkDevice(device, "orMalloc")) return err;
  if (orError_t err = openreg::checkNotForked("orMalloc")) return err;
  *ptr = nullptr;
  if (size == 0) return orSuccess;
  return allocator(device).allocate(size, ptr);
}

orError_t orFree(void* ptr) {
  if (!ptr) return orSuccess;
  openreg::Region region;
  if (openreg::findRegion(ptr, &region) && !region.imported &&
      allocator(region.device).release((uintptr_t)ptr))
    return orSuccess;
  return fail(orErrorInvalidValue,
              "orFree(%p): not a live pointer returned by orMalloc (already freed, an interior "
              "pointer, or IPC-mapped memory, which orIpcCloseMemHandle releases)",
              ptr);
}

orError_t orEmptyCache(int device) {
  if (orError_t err = checkDevice(device, "orEmptyCache")) return err;
  allocator(device).emptyCache();
  return orSuccess;
}

orError_t orMemGetInfo(int device, size_t* free, size_t* total) {
  if (orError_t err = checkDevice(device, "orMemGetInfo")) return err;
  if (!free || !total) return fail(orErrorInvalidValue, "orMemGetInfo: NULL argument");
  long pages = sysconf(_SC_PHYS_PAGES), pageSize = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || pageSize <= 0)
    return fail(orErrorOsCall, "orMemGetInfo: sysconf cannot tell the host's memory size");
  *total = (size_t)pages * (size_t)pageSize;
  *free = std::min(availableHostMemory(), *total);
  return orSuccess;
}

orError_t orHostAlloc(void** ptr, size_t size) {
  if (!ptr) return fail(orErrorInvalidValue, "orHostAlloc: ptr is NULL");
  if (orError_t err = openreg::checkNotForked("orHostAlloc")) return err;
  *ptr = nullptr;
  if (size == 0) return orSuccess;
  // The C library's allocator: cheap for the many small blocks of non-blocking copies to the host.
  void* base = nullptr;
  if (int err = posix_memalign(&base, kHostAlign, size))
    return fail(orErrorMemoryAllocation, "orHostAlloc: cannot allocate %zu bytes: %s", size,
                openreg::osError(err));
  HostBlocks& h = hostBlocks();
  std::lock_guard<std::mutex> lock(h.mutex);
  h.blocks[(uintptr_t)base] = size;
  *ptr = base;
  return orSuccess;
}

orError_t orFreeHost(void* ptr) {
  if (!ptr) return orSuccess;
  HostBlocks& h = hostBlocks();
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    auto it = h.blocks.find((uintptr_t)ptr);
    if (it == h.blocks.end())
      return fail(orErrorInvalidValue, "orFreeHost(%p): not a live pointer returned by orHostAlloc",
                  ptr);
    h.blocks.erase(it);
  }
  free(ptr);
  return orSuccess;
}

orError_t orMemGetStats(int device, orMemStats* stats) {
  if (orError_t err = checkDevice(device, "orMemGetStats")) return err;
  if (!stats) return fail(orErrorInvalidValue, "orMemGetStats: stats is NULL");
  DeviceAllocator& a = allocator(device);
  std::lock_guard<std::mutex> lock(a.mutex);
  *stats = a.stats;
  return orSuccess;
}

orError_t orMemResetPeakStats(int device) {
  if (orError_t err = checkDevice(device, "orMemResetPeakStats")) return err;
  DeviceAllocator& a = allocator(device);
  std::lock_guard<std::mutex> lock(a.mutex);
  a.stats.peak_allocated = a.stats.allocated;
  a.stats.peak_reserved = a.stats.reserved;
  return orSuccess;
}

orError_t orMemResetAccumulatedStats(int device) {
  if (orError_t err = checkDevice(device, "orMemResetAccumulatedStats")) return err;
  DeviceAllocator& a = allocator(device);
  std::lock_guard<std::mutex> lock(a.mutex);
  a.stats.num_allocs = 0;
  a.stats.num_frees = 0;
  return orSuccess;
}

}  // extern "C"
