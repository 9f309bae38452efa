// Shared internals of the openreg runtime. Nothing here is exported: the C API is openreg.h.
//
// Lifetime rule: every global object is created with `new` on first use and never destroyed, so
// stream worker threads still running during exit() never touch a destroyed mutex or map.
#pragma once
#include <stdint.h>
#include <sys/types.h>

#include <condition_variable>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "openreg.h"

namespace openreg {

// ---- errors (error.cpp) -------------------------------------------------------------------------
// Records a printf-style message as this thread's last error and returns `err`.
orError_t fail(orError_t err, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
#if defined(__clang_analyzer__) && !defined(OPENREG_DEFINES_FAIL)
// clang-tidy's analyzer does not follow calls of variadic functions: it would take a failing call
// for one that may have succeeded. Under analysis only, a fail() is its error.
template <typename... Args>
orError_t analyzedFail(orError_t err, Args&&...) {
  return err;
}
#define fail(...) ::openreg::analyzedFail(__VA_ARGS__)
#endif
// strerror's text for errno `e`, in a buffer of the calling thread (strerror may share one).
const char* osError(int e);

// ---- devices (device.cpp) -----------------------------------------------------------------------
int deviceCount();
bool validDevice(int device);
int physicalIndex(int device);  // local -> physical
int localIndex(int physical);   // physical -> local, -1 if not visible
int currentDevice();
orError_t checkDevice(int device, const char* call);  // orErrorInvalidDevice with a message
orError_t checkNotForked(const char* call);  // orErrorInitialization in a child forked after use

// ---- memory regions (region.cpp) ----------------------------------------------------------------
// A region is a mapping that holds device memory: one of our segments or an imported IPC mapping.
// It carries what an IPC handle needs, so a pointer into either kind can be exported again.
constexpr size_t kTokenSize = 16;
struct Region {
  uintptr_t base = 0;
  size_t size = 0;
  int device = -1;    // local index
  int physical = -1;  // physical index, what a handle carries
  bool imported = false;
  pid_t pid = 0;  // process that owns the memfd
  int fd = -1;    // memfd number in that process
  unsigned char token[kTokenSize] = {};
};
void registerRegion(const Region& region);
void unregisterRegion(uintptr_t base);
bool findRegion(const void* ptr, Region* out);  // ptr may point anywhere inside the region

// ---- pinned host memory (allocator.cpp) ---------------------------------------------------------
bool findHostBlock(const void* ptr, uintptr_t* base, size_t* size);  // an orHostAlloc block

// A memfd named "openreg:<tag>:<tokenhex>", sized, mapped MAP_SHARED. The fd stays open: an
// importer reaches the memory through /proc/<pid>/fd/<fd>.
struct SharedFile {
  void* base = nullptr;
  size_t size = 0;
  int fd = -1;
  unsigned char token[kTokenSize] = {};
};
orError_t createSharedFile(const char* call, const char* tag, size_t size, SharedFile* out);
void tokenHex(const unsigned char* token, char out[2 * kTokenSize + 1]);

// ---- interprocess events (ipc_event.cpp) --------------------------------------------------------
// An interprocess event lives in a slot of its creator's shared event page, so every process that
// opened it sees and makes its records: `latest` (seq and recorder pid of the latest record) and
// `completed` (highest seq whose record ran). docs/ipc-handles.md has the layout.
struct IpcEvent;  // the shared part of one interprocess event, local or opened from a handle
orError_t createIpcEvent(std::shared_ptr<IpcEvent>* out);
// Takes the next seq of the event and queues its completion on `stream`.
orError_t recordIpcEvent(const std::shared_ptr<IpcEvent>& event, orStream_t stream,
                         const char* call);
// The latest record at the time of the call; seq 0: nothing to wait for.
struct IpcWait {
  std::shared_ptr<IpcEvent> event;  // keeps the page mapped while someone waits
  uint32_t seq = 0;
  pid_t recorder = 0;
};
IpcWait ipcWaitTarget(const std::shared_ptr<IpcEvent>& event);
enum class IpcState { kDone, kPending, kRecorderGone };
IpcState ipcQuery(const IpcWait& wait);
IpcState ipcBlock(const IpcWait& wait);                         // kDone or kRecorderGone
orError_t ipcGoneError(const IpcWait& wait, const char* call);  // orErrorPeerGone, with a message

// True while `pid` runs (zombies count as gone: their fds are already closed).
bool processAlive(pid_t pid);

}  // namespace openreg

// ---- streams and events (stream.cpp, event.cpp) -------------------------------------------------
struct orStream {
  int device = 0;
  int64_t id = 0;
  std::mutex mutex;
  std::condition_variable workReady;
  std::condition_variable workDone;
  std::deque<std::pair<std::function<void()>, std::function<void()>>> queue;  // (task, after)
  uint64_t enqueued = 0;                                                      // tasks ever enqueued
  uint64_t completed = 0;  // tasks ever finished; the stream is idle when equal
  bool stopping = false;
  std::thread worker;
};

// One record of an event. Shared by the event and the queued marker, so destroying an event
// while its record is pending is safe.
struct EventRecord {
  std::mutex mutex;
  std::condition_variable doneCv;
  bool done = false;
  std::chrono::steady_clock::time_point when;
};

struct orEvent {
  unsigned int flags = 0;
  std::mutex mutex;
  std::shared_ptr<EventRecord> last;       // latest record, null if never recorded
  std::shared_ptr<openreg::IpcEvent> ipc;  // interprocess events: records live there instead
};

namespace openreg {
// NULL -> default stream of the current device. Fails (with a message) on an unknown handle.
orError_t resolveStream(orStream_t stream, const char* call, orStream_t* out);
// `after` runs on the worker once the stream counts `task` as completed: an event record uses it,
// so that a completed event implies that orStreamQuery sees the work before it as done.
void enqueue(orStream_t stream, std::function<void()> task, std::function<void()> after = nullptr);
orError_t synchronizeStream(orStream_t stream, const char* call);
// Waits for the work queued on every stream of `device`, except the stream whose worker is the
// calling thread (memory released from a host function must not wait for itself).
void drainDevice(int device);
orError_t checkEvent(orEvent_t event, const char* call);  // orErrorInvalidResourceHandle if unknown
}  // namespace openreg
