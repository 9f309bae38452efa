// Events: a record is a marker task on a stream; waiting on an event is a task that blocks until
// the marker has run. Interprocess events keep their records in a shared event page instead
// (ipc_event.cpp), so that every process that opened one sees its latest record.
#include <unordered_set>

#include "internal.h"

namespace {

using openreg::fail;

struct EventTable {
  std::mutex mutex;
  std::unordered_set<orEvent*> live;
};

EventTable& table() {
  static EventTable* t = new EventTable();
  return *t;
}

void markDone(const std::shared_ptr<EventRecord>& record) {
  std::lock_guard<std::mutex> lock(record->mutex);
  record->when = std::chrono::steady_clock::now();
  record->done = true;
  record->doneCv.notify_all();
}

void waitDone(const std::shared_ptr<EventRecord>& record) {
  std::unique_lock<std::mutex> lock(record->mutex);
  record->doneCv.wait(lock, [&] { return record->done; });
}

bool isDone(const std::shared_ptr<EventRecord>& record) {
  std::lock_guard<std::mutex> lock(record->mutex);
  return record->done;
}

// What a waiter needs, taken at wait time, so the event may be destroyed or recorded meanwhile.
struct Snapshot {
  bool interprocess;
  openreg::IpcWait wait;  // interprocess events
  std::shared_ptr<EventRecord> record;
};

Snapshot snapshot(orEvent_t event) {
  if (event->ipc) return Snapshot{true, openreg::ipcWaitTarget(event->ipc), nullptr};
  std::lock_guard<std::mutex> lock(event->mutex);
  return Snapshot{false, {}, event->last};
}

}  // namespace

namespace openreg {
orError_t checkEvent(orEvent_t event, const char* call) {
  std::lock_guard<std::mutex> lock(table().mutex);
  if (event && table().live.count(event)) return orSuccess;
  return fail(orErrorInvalidResourceHandle, "%s: %p is not a live event (destroyed?)", call,
              (void*)event);
}
}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orEventCreate(orEvent_t* event) {
  return orEventCreateWithFlags(event, orEventDefault);
}

orError_t orEventCreateWithFlags(orEvent_t* event, unsigned int flags) {
  if (!event) return fail(orErrorInvalidValue, "orEventCreateWithFlags: event is NULL");
  if (flags & ~(unsigned)(orEventDisableTiming | orEventInterprocess))
    return fail(orErrorInvalidValue, "orEventCreateWithFlags: unknown flags 0x%x", flags);
  if ((flags & orEventInterprocess) && !(flags & orEventDisableTiming))
    return fail(orErrorInvalidValue,
                "orEventCreateWithFlags: orEventInterprocess needs orEventDisableTiming too");
  orEvent* e = new orEvent();
  e->flags = flags;
  if (flags & orEventInterprocess) {
    if (orError_t err = createIpcEvent(&e->ipc)) {
      delete e;
      return err;
    }
  }
  std::lock_guard<std::mutex> lock(table().mutex);
  table().live.insert(e);
  *event = e;
  return orSuccess;
}

orError_t orEventDestroy(orEvent_t event) {
  {
    std::lock_guard<std::mutex> lock(table().mutex);
    if (!table().live.erase(event))
      return fail(orErrorInvalidResourceHandle, "orEventDestroy: %p is not a live event",
                  (void*)event);
  }
  delete event;  // a pending marker or wait holds its own reference to what it needs
  return orSuccess;
}

orError_t orEventRecord(orEvent_t event, orStream_t stream) {
  if (orError_t err = checkEvent(event, "orEventRecord")) return err;
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orEventRecord", &s)) return err;
  if (event->ipc) return recordIpcEvent(event->ipc, s, "orEventRecord");
  auto record = std::make_shared<EventRecord>();
  {
    std::lock_guard<std::mutex> lock(event->mutex);
    event->last = record;
  }
  enqueue(s, [] {}, [record] { markDone(record); });
  return orSuccess;
}

orError_t orEventQuery(orEvent_t event) {
  if (orError_t err = checkEvent(event, "orEventQuery")) return err;
  Snapshot snap = snapshot(event);
  if (snap.interprocess) {
    IpcState state = ipcQuery(snap.wait);
    if (state == IpcState::kRecorderGone) return ipcGoneError(snap.wait, "orEventQuery");
    return state == IpcState::kDone ? orSuccess : orErrorNotReady;
  }
  return !snap.record || isDone(snap.record) ? orSuccess : orErrorNotReady;
}

orError_t orEventSynchronize(orEvent_t event) {
  if (orError_t err = checkEvent(event, "orEventSynchronize")) return err;
  Snapshot snap = snapshot(event);
  if (snap.interprocess) {
    if (ipcBlock(snap.wait) == IpcState::kRecorderGone)
      return ipcGoneError(snap.wait, "orEventSynchronize");
  } else if (snap.record) {
    waitDone(snap.record);
  }
  return orSuccess;
}

orError_t orEventElapsedTime(float* ms, orEvent_t start, orEvent_t end) {
  if (!ms) return fail(orErrorInvalidValue, "orEventElapsedTime: ms is NULL");
  if (orError_t err = checkEvent(start, "orEventElapsedTime")) return err;
  if (orError_t err = checkEvent(end, "orEventElapsedTime")) return err;
  if ((start->flags | end->flags) & orEventDisableTiming)
    return fail(
        orErrorInvalidValue,
        "orEventElapsedTime: both events need timing (created without orEventDisableTiming)");
  Snapshot a = snapshot(start), b = snapshot(end);
  if (!a.record || !b.record)
    return fail(orErrorInvalidValue, "orEventElapsedTime: both events must have been recorded");
  if (!isDone(a.record) || !isDone(b.record))
    return fail(orErrorNotReady, "orEventElapsedTime: an event's record has not completed yet");
  std::chrono::duration<float, std::milli> diff = b.record->when - a.record->when;
  *ms = diff.count();
  return orSuccess;
}

orError_t orStreamWaitEvent(orStream_t stream, orEvent_t event, unsigned int flags) {
  if (flags != 0) return fail(orErrorInvalidValue, "orStreamWaitEvent: flags must be 0");
  if (orError_t err = checkEvent(event, "orStreamWaitEvent")) return err;
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamWaitEvent", &s)) return err;
  Snapshot snap = snapshot(event);
  if (snap.interprocess) {
    // A recorder that exited releases the stream: its work can no longer complete.
    if (snap.wait.seq != 0) enqueue(s, [wait = snap.wait] { ipcBlock(wait); });
  } else if (snap.record)
    enqueue(s, [record = snap.record] { waitDone(record); });
  return orSuccess;
}

}  // extern "C"
