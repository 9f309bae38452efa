// Interprocess events, with CUDA's semantics: a handle names the EVENT, not one record. Each
// process owns one shared event page (a memfd, like segments) of slots; an interprocess event takes
// a slot at creation. The slot holds the event's state for every process that opened it:
// `latest` (seq and recorder pid of the latest record) and `completed` (highest seq whose record
// ran). A record, by the creator or by any importer, takes the next seq with a compare-and-swap
// and queues its completion on its stream; a waiter reads `latest` at wait time and waits until
// `completed` reaches that seq. So a handle taken before a record still orders after it, and the
// creator's waits see an importer's records.
//
// A waiter never hangs on a dead recorder: it sleeps on the futex at most kPollMs at a time and
// gives up once the recorder of the seq it waits for has exited (kRecorderGone). Known limits: a
// recycled pid of that recorder looks alive, so that waiter keeps waiting; and `completed` is one
// counter, so when records of one event run on several streams at once, a wait for an earlier
// record also ends when a later record completes first.
//
// A slot's `epoch` is odd while its event lives. Destroying the event frees the slot only once
// this process's pending records of it have run; the epoch then moves on, so a handle of the
// destroyed event opens as an event with nothing left to wait for (it cannot be recorded).
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

// Layout in docs/ipc-handles.md: kSlots slots of 16 bytes.
struct Slot {
  uint32_t epoch;      // odd: an event lives here; 0: never handed out
  uint32_t completed;  // highest seq whose record ran (futex word)
  uint64_t latest;     // recorder pid << 32 | seq of the latest record; 0: never recorded
};
static_assert(sizeof(Slot) == 16, "slot layout");
constexpr int kSlots = 8192;
constexpr size_t kPageBytes = kSlots * sizeof(Slot);
constexpr long kPollMs = 50;

// This process's page. Its fd stays open for the life of the process (importers reach it).
struct LocalPage {
  std::mutex mutex;
  SharedFile file;
  std::vector<uint32_t> epochs;  // the truth (importers map the page writable); only grow
  std::vector<int> freeSlots;
  int nextSlot = 0;
};

LocalPage& localPage() {
  static LocalPage* p = new LocalPage();
  return *p;
}

// Wrap-safe: a counter that has passed `seq` by less than 2^31 counts as reached.
bool reached(uint32_t value, uint32_t seq) {
  return (int32_t)(value - seq) >= 0;
}

uint32_t seqOf(uint64_t latest) {
  return (uint32_t)latest;
}
pid_t pidOf(uint64_t latest) {
  return (pid_t)(latest >> 32);
}

}  // namespace

// Another process's page, mapped here; one mapping per page, shared by the events opened from it.
struct ImportedPage {
  HandleData handle;  // of the page: pid, fd, size, token
  void* base = nullptr;
  ~ImportedPage() {
    munmap(base, handle.size);
  }
};

struct IpcEvent {
  Slot* slot = nullptr;
  int index = -1;
  uint32_t epoch = 0;
  bool retired = false;                // opened after its creator destroyed it: never waits
  std::shared_ptr<ImportedPage> page;  // null: the slot is in this process's page
  ~IpcEvent() {
    if (page) return;
    // Last reference: the event is destroyed and its records here have run.
    LocalPage& p = localPage();
    std::lock_guard<std::mutex> lock(p.mutex);
    p.epochs[index] += 1;  // even: free
    __atomic_store_n(&slot->epoch, p.epochs[index], __ATOMIC_RELEASE);
    p.freeSlots.push_back(index);
  }
};

namespace {

struct PageCache {
  std::mutex mutex;
  std::map<std::string, std::weak_ptr<ImportedPage>> byToken;
};

PageCache& pageCache() {
  static PageCache* c = new PageCache();
  return *c;
}

Slot* slotAt(void* base, int index) {
  return (Slot*)base + index;
}

// False once the event's creator destroyed it (the slot's epoch moved on).
bool live(const IpcEvent& e) {
  return !e.retired && __atomic_load_n(&e.slot->epoch, __ATOMIC_ACQUIRE) == e.epoch;
}

void publishCompleted(Slot* slot, uint32_t seq) {
  uint32_t current = __atomic_load_n(&slot->completed, __ATOMIC_ACQUIRE);
  // Records on different streams may complete out of order: never go back.
  while (!reached(current, seq) &&
         !__atomic_compare_exchange_n(&slot->completed, &current, seq, false, __ATOMIC_RELEASE,
                                      __ATOMIC_ACQUIRE)) {
  }
  // Not FUTEX_PRIVATE: the waiters live in other processes, on their own mapping of the page.
  syscall(SYS_futex, &slot->completed, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool completedReached(const IpcWait& wait) {
  return reached(__atomic_load_n(&wait.event->slot->completed, __ATOMIC_ACQUIRE), wait.seq);
}

}  // namespace

orError_t createIpcEvent(std::shared_ptr<IpcEvent>* out) {
  const char* call = "orEventCreateWithFlags";
  LocalPage& p = localPage();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (!p.file.base) {
    if (orError_t err = createSharedFile(call, "progress", kPageBytes, &p.file)) return err;
    p.epochs.assign(kSlots, 0);
  }
  int index;
  if (!p.freeSlots.empty()) {
    index = p.freeSlots.back();
    p.freeSlots.pop_back();
  } else if (p.nextSlot < kSlots) {
    index = p.nextSlot++;
  } else {
    return fail(orErrorMemoryAllocation,
                "%s: more than %d interprocess events live (or have pending records) in this "
                "process; destroy unused ones",
                call, kSlots);
  }
  auto e = std::make_shared<IpcEvent>();
  e->slot = slotAt(p.file.base, index);
  e->index = index;
  e->epoch = p.epochs[index] += 1;  // odd: live
  __atomic_store_n(&e->slot->epoch, e->epoch, __ATOMIC_RELEASE);
  *out = std::move(e);
  return orSuccess;
}

orError_t recordIpcEvent(const std::shared_ptr<IpcEvent>& event, orStream_t stream,
                         const char* call) {
  if (!live(*event))
    return fail(orErrorInvalidResourceHandle,
                "%s: process %d destroyed this interprocess event; it can no longer be recorded",
                call, event->page ? event->page->handle.pid : (int)getpid());
  Slot* slot = event->slot;
  uint64_t old = __atomic_load_n(&slot->latest, __ATOMIC_ACQUIRE), next;
  uint32_t seq;
  do {
    seq = seqOf(old) + 1;
    if (seq == 0) seq = 1;  // 0 stays "never recorded", even after 2^32 records
    next = (uint64_t)(uint32_t)getpid() << 32 | seq;
  } while (!__atomic_compare_exchange_n(&slot->latest, &old, next, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE));
  // Published once the stream counts the work before it as done (orStreamQuery agrees).
  enqueue(stream, [] {}, [event, seq] { publishCompleted(event->slot, seq); });
  return orSuccess;
}

IpcWait ipcWaitTarget(const std::shared_ptr<IpcEvent>& event) {
  IpcWait wait;
  if (!live(*event)) return wait;
  uint64_t latest = __atomic_load_n(&event->slot->latest, __ATOMIC_ACQUIRE);
  // Re-checked: a slot reused meanwhile holds another event's record.
  if (!live(*event) || seqOf(latest) == 0) return wait;
  wait.event = event;
  wait.seq = seqOf(latest);
  wait.recorder = pidOf(latest);
  return wait;
}

IpcState ipcQuery(const IpcWait& wait) {
  if (wait.seq == 0 || completedReached(wait)) return IpcState::kDone;
  if (processAlive(wait.recorder)) return IpcState::kPending;
  return completedReached(wait) ? IpcState::kDone : IpcState::kRecorderGone;
}

IpcState ipcBlock(const IpcWait& wait) {
  if (wait.seq == 0) return IpcState::kDone;
  uint32_t* addr = &wait.event->slot->completed;
  for (;;) {
    uint32_t value = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    if (reached(value, wait.seq)) return IpcState::kDone;
    struct timespec timeout = {0, kPollMs * 1000000};
    long rc = syscall(SYS_futex, addr, FUTEX_WAIT, value, &timeout, nullptr, 0);
    if (rc != 0 && errno == ETIMEDOUT && !processAlive(wait.recorder))
      return completedReached(wait) ? IpcState::kDone : IpcState::kRecorderGone;
  }
}

orError_t ipcGoneError(const IpcWait& wait, const char* call) {
  return fail(orErrorPeerGone,
              "%s: process %d exited before its record of the interprocess event completed", call,
              (int)wait.recorder);
}

}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orIpcGetEventHandle(orIpcEventHandle_t* handle, orEvent_t event) {
  const char* call = "orIpcGetEventHandle";
  if (!handle) return fail(orErrorInvalidValue, "%s: handle is NULL", call);
  if (orError_t err = checkEvent(event, call)) return err;
  if (!event->ipc)
    return fail(orErrorInvalidValue,
                "%s: create the event with orEventInterprocess | orEventDisableTiming", call);
  const IpcEvent& e = *event->ipc;
  HandleData h;
  if (e.page) {
    h = e.page->handle;  // re-export: the handle names the creator's page
  } else {
    LocalPage& p = localPage();
    std::lock_guard<std::mutex> lock(p.mutex);
    h = newHandle(kEventHandle, getpid(), p.file.fd, p.file.size, p.file.token);
  }
  h.slot = e.index;
  h.epoch = e.epoch;
  memcpy(handle->reserved, &h, sizeof(h));
  return orSuccess;
}

orError_t orIpcOpenEventHandle(orEvent_t* event, orIpcEventHandle_t handle) {
  const char* call = "orIpcOpenEventHandle";
  if (!event) return fail(orErrorInvalidValue, "%s: event is NULL", call);
  HandleData h;
  if (orError_t err = decodeHandle(handle.reserved, kEventHandle, call, &h)) return err;
  if (h.size != kPageBytes || h.slot < 0 || h.slot >= kSlots || h.epoch % 2 != 1)
    return fail(orErrorInvalidHandle,
                "%s: corrupted event handle (page %llu bytes, slot %d, epoch %u; this runtime's "
                "pages are %zu bytes of %d slots, epochs odd)",
                call, (unsigned long long)h.size, h.slot, h.epoch, kPageBytes, kSlots);
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
      page->handle.epoch = 0;
      cache.byToken[token] = page;
    }
  }
  auto e = std::make_shared<IpcEvent>();
  e->page = page;
  e->slot = slotAt(page->base, h.slot);
  e->index = h.slot;
  e->epoch = h.epoch;
  // Checked before anything waits: an epoch the slot never reached names no event at all.
  uint32_t current = __atomic_load_n(&e->slot->epoch, __ATOMIC_ACQUIRE);
  if (current == 0)
    return fail(orErrorInvalidHandle,
                "%s: process %d never handed out event slot %d: the event handle is forged", call,
                h.pid, h.slot);
  if (!reached(current, h.epoch))
    return fail(orErrorInvalidHandle,
                "%s: the event handle names epoch %u of event slot %d, but process %d is only at "
                "epoch %u there: the handle is forged",
                call, h.epoch, h.slot, h.pid, current);
  e->retired = current != h.epoch;  // destroyed by its creator after its records ran
  orEvent_t opened;
  if (orError_t err = orEventCreateWithFlags(&opened, orEventDisableTiming)) return err;
  opened->flags |= orEventInterprocess;
  opened->ipc = std::move(e);
  *event = opened;
  return orSuccess;
}

}  // extern "C"
