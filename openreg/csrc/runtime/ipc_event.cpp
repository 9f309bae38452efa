// Interprocess events. Each process owns one shared progress page (a memfd, like segments) holding
// two uint32 arrays indexed by slot, one slot per stream: `progress`, the last sequence number whose
// marker ran, and `reserved`, the last one handed to a record. Recording an interprocess event
// reserves the stream's next sequence number (published in `reserved` at once); the marker stores
// it into `progress` and wakes futex waiters. A handle carries (page, slot, seq); an importer maps
// the page, refuses a seq the exporter never reserved in that slot, and waits until `progress`
// reaches seq. So an accepted handle names a record that was really made: the wait ends when the
// exporter's queued work does.
//
// A waiter never hangs on a dead exporter: it sleeps on the futex at most kPollMs at a time and
// gives up once the exporter has exited (a record that can no longer complete counts as done).
// Known limit: a recycled pid of the dead exporter looks alive, so that waiter keeps waiting.
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "ipc_handle.h"

namespace openreg {

namespace {

// Layout in docs/ipc-handles.md: progress[kSlots] at offset 0, reserved[kSlots] right after.
constexpr int kSlots = 4096;
constexpr size_t kPageBytes = 2 * kSlots * sizeof(uint32_t);
constexpr long kPollMs = 50;

// This process's page. Its fd stays open for the life of the process (importers reach it).
struct LocalPage {
  std::mutex mutex;
  SharedFile file;
  std::vector<uint32_t> lastSeq;  // per slot, kept when a slot is reused so values only grow
  std::vector<int> freeSlots;
  int nextSlot = 0;
};

LocalPage& localPage() {
  static LocalPage* p = new LocalPage();
  return *p;
}

// Call with localPage().mutex held.
orError_t ensurePage(const char* call) {
  LocalPage& p = localPage();
  if (p.file.base) return orSuccess;
  if (orError_t err = createSharedFile(call, "progress", kPageBytes, &p.file)) return err;
  p.lastSeq.assign(kSlots, 0);
  return orSuccess;
}

uint32_t* slotAddress(void* base, int slot) { return (uint32_t*)base + slot; }
uint32_t* reservedAddress(void* base, int slot) { return (uint32_t*)base + kSlots + slot; }

// Wrap-safe: a counter that has passed `seq` by less than 2^31 counts as reached.
bool reached(uint32_t value, uint32_t seq) { return (int32_t)(value - seq) >= 0; }

// Opened pages, one mapping per exporter page, shared by the events opened from it.
struct PageCache {
  std::mutex mutex;
  std::map<std::string, std::weak_ptr<ImportedPage>> byToken;
};

PageCache& pageCache() {
  static PageCache* c = new PageCache();
  return *c;
}

}  // namespace

struct ImportedPage {
  HandleData handle;  // of the page: pid, fd, size, token
  void* base = nullptr;
  ~ImportedPage() { munmap(base, handle.size); }
};

orError_t reserveProgressMark(orStream_t stream, ProgressMark* mark) {
  LocalPage& p = localPage();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (orError_t err = ensurePage("orEventRecord")) return err;
  if (stream->progressSlot < 0) {
    if (!p.freeSlots.empty()) {
      stream->progressSlot = p.freeSlots.back();
      p.freeSlots.pop_back();
    } else if (p.nextSlot < kSlots) {
      stream->progressSlot = p.nextSlot++;
    } else {
      return fail(orErrorMemoryAllocation,
                  "orEventRecord: more than %d live streams have recorded interprocess events; "
                  "destroy unused streams",
                  kSlots);
    }
  }
  mark->slot = stream->progressSlot;
  // 0 stays "never handed out", even after 2^32 records on one slot.
  if (++p.lastSeq[mark->slot] == 0) ++p.lastSeq[mark->slot];
  mark->seq = p.lastSeq[mark->slot];
  // Published before any handle can name it; lastSeq stays the truth, since importers map the
  // page writable.
  __atomic_store_n(reservedAddress(p.file.base, mark->slot), mark->seq, __ATOMIC_RELEASE);
  return orSuccess;
}

void publishProgress(const ProgressMark& mark) {
  uint32_t* addr = slotAddress(localPage().file.base, mark.slot);
  // Two records on one stream may reserve in one order and enqueue in the other: never go back.
  uint32_t current = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
  while (!reached(current, mark.seq) &&
         !__atomic_compare_exchange_n(addr, &current, mark.seq, false, __ATOMIC_RELEASE,
                                      __ATOMIC_ACQUIRE)) {
  }
  // Not FUTEX_PRIVATE: the waiters live in other processes, on their own mapping of the page.
  syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void releaseProgressSlot(int slot) {
  if (slot < 0) return;
  std::lock_guard<std::mutex> lock(localPage().mutex);
  localPage().freeSlots.push_back(slot);
}

bool importedDone(const ImportedWait& wait) {
  if (wait.slot < 0) return true;
  uint32_t value = __atomic_load_n(slotAddress(wait.page->base, wait.slot), __ATOMIC_ACQUIRE);
  return reached(value, wait.seq) || !processAlive(wait.page->handle.pid);
}

void importedWait(const ImportedWait& wait) {
  if (wait.slot < 0) return;
  uint32_t* addr = slotAddress(wait.page->base, wait.slot);
  for (;;) {
    uint32_t value = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    if (reached(value, wait.seq)) return;
    struct timespec timeout = {0, kPollMs * 1000000};
    long rc = syscall(SYS_futex, addr, FUTEX_WAIT, value, &timeout, nullptr, 0);
    if (rc != 0 && errno == ETIMEDOUT && !processAlive(wait.page->handle.pid)) return;
  }
}

}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orIpcGetEventHandle(orIpcEventHandle_t* handle, orEvent_t event) {
  const char* call = "orIpcGetEventHandle";
  if (!handle) return fail(orErrorInvalidValue, "%s: handle is NULL", call);
  if (orError_t err = checkEvent(event, call)) return err;
  if (!(event->flags & orEventInterprocess))
    return fail(orErrorInvalidValue,
                "%s: create the event with orEventInterprocess | orEventDisableTiming", call);
  HandleData h;
  {
    std::lock_guard<std::mutex> lock(event->mutex);
    if (event->imported) {
      // Re-export: the handle names the original exporter's page and record.
      h = event->wait.page->handle;
      h.slot = event->wait.slot;
      h.seq = event->wait.seq;
    } else {
      h.slot = event->mark.slot;
      h.seq = event->mark.seq;
    }
  }
  if (!event->imported) {
    LocalPage& p = localPage();
    std::lock_guard<std::mutex> lock(p.mutex);
    // Even a never-recorded event names the page, so opening it checks the exporter like memory.
    if (orError_t err = ensurePage(call)) return err;
    HandleData page = newHandle(kEventHandle, getpid(), p.file.fd, p.file.size, p.file.token);
    page.slot = h.slot;
    page.seq = h.seq;
    h = page;
  }
  memcpy(handle->reserved, &h, sizeof(h));
  return orSuccess;
}

orError_t orIpcOpenEventHandle(orEvent_t* event, orIpcEventHandle_t handle) {
  const char* call = "orIpcOpenEventHandle";
  if (!event) return fail(orErrorInvalidValue, "%s: event is NULL", call);
  HandleData h;
  if (orError_t err = decodeHandle(handle.reserved, kEventHandle, call, &h)) return err;
  // A genuine record has seq >= 1; a never-recorded event has slot -1 and seq 0.
  if (h.size != kPageBytes || h.slot < -1 || h.slot >= kSlots || (h.slot < 0) != (h.seq == 0))
    return fail(orErrorInvalidHandle,
                "%s: corrupted event handle (page %llu bytes, slot %d, seq %u; this runtime's "
                "pages are %zu bytes)",
                call, (unsigned long long)h.size, h.slot, h.seq, kPageBytes);
  std::shared_ptr<ImportedPage> page;
  {
    PageCache& cache = pageCache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    for (auto it = cache.byToken.begin(); it != cache.byToken.end();)
      it = it->second.expired() ? cache.byToken.erase(it) : std::next(it);
    std::string token((const char*)h.token, kTokenSize);
    page = cache.byToken[token].lock();
    if (!page) {
      void* base;
      if (orError_t err = mapPeerFile(h, call, &base)) {
        cache.byToken.erase(token);
        return err;
      }
      page = std::make_shared<ImportedPage>();
      page->base = base;
      page->handle = h;
      page->handle.slot = -1;
      page->handle.seq = 0;
      cache.byToken[token] = page;
    }
  }
  if (h.slot >= 0) {
    // Checked before anything waits: a seq beyond what the exporter reserved (wrap-safe) would
    // wait for a record that may never come, as long as the exporter lives.
    uint32_t reserved = __atomic_load_n(reservedAddress(page->base, h.slot), __ATOMIC_ACQUIRE);
    if (reserved == 0)
      return fail(orErrorInvalidHandle,
                  "%s: process %d never handed out progress slot %d: the event handle is forged",
                  call, h.pid, h.slot);
    if (!reached(reserved, h.seq))
      return fail(orErrorInvalidHandle,
                  "%s: the event handle names record %u of progress slot %d, but process %d has "
                  "reserved only up to %u there: the handle is forged",
                  call, h.seq, h.slot, h.pid, reserved);
  }
  orEvent_t e;
  if (orError_t err = orEventCreateWithFlags(&e, orEventInterprocess | orEventDisableTiming))
    return err;
  e->imported = true;
  e->wait = ImportedWait{page, h.slot, h.seq};
  *event = e;
  return orSuccess;
}

}  // extern "C"
