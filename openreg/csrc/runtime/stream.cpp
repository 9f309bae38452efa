// Streams: one worker thread each, running its queue in FIFO order; host functions and copies.
//
// Worker threads are never joined at exit and their streams are never destroyed by it (see
// internal.h), so exiting with work still queued neither hangs nor touches freed state: the
// kernel ends the workers with the process.
#include <pthread.h>
#include <signal.h>
#include <string.h>

#include <map>
#include <memory>
#include <vector>

#include "internal.h"

namespace {

using openreg::fail;

// Owns the streams. Handles are raw pointers, but the table keeps a shared_ptr so that
// orDeviceSynchronize can wait on a stream that another thread destroys meanwhile.
struct StreamTable {
  std::mutex mutex;
  std::map<orStream*, std::shared_ptr<orStream>> live;
  std::map<std::pair<int, int64_t>, orStream*> byId;  // (device, id)
  std::vector<int64_t> nextId;                        // per device; 0 is the default stream
};

StreamTable& table() {
  static StreamTable* t = [] {
    auto* t = new StreamTable();
    t->nextId.assign(openreg::deviceCount(), 1);
    return t;
  }();
  return *t;
}

void workerLoop(orStream* s) {
  std::unique_lock<std::mutex> lock(s->mutex);
  for (;;) {
    s->workReady.wait(lock, [s] { return s->stopping || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stopping, and everything enqueued has run
    auto [task, after] = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // release what the task captured before reporting it done
    lock.lock();
    s->completed++;
    // Under the stream's lock, together with `completed`: a synchronize or query that sees the
    // task done also sees the event it records done (`after` is internal, never user code).
    if (after) after();
    after = nullptr;
    s->workDone.notify_all();
  }
}

// Call with table().mutex held.
orStream* createLocked(int device, int64_t id) {
  auto s = std::make_shared<orStream>();
  s->device = device;
  s->id = id;
  // Asynchronous signals go to the application's threads, never to a worker; faults still
  // reach their handlers (a crash report should name the worker).
  sigset_t all, old;
  sigfillset(&all);
  for (int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) sigdelset(&all, fault);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  s->worker = std::thread(workerLoop, s.get());
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  table().live[s.get()] = s;
  table().byId[{device, id}] = s.get();
  return s.get();
}

orStream* defaultStream(int device) {
  std::lock_guard<std::mutex> lock(table().mutex);
  auto it = table().byId.find({device, 0});
  return it != table().byId.end() ? it->second : createLocked(device, 0);
}

bool isDeviceMemory(const void* ptr, size_t count) {
  openreg::Region r;
  return openreg::findRegion(ptr, &r) && count <= r.size - ((uintptr_t)ptr - r.base);
}

orError_t checkCopy(const char* call, void* dst, const void* src, size_t count, orMemcpyKind kind) {
  if (kind < orMemcpyHostToHost || kind > orMemcpyDeviceToDevice)
    return fail(orErrorInvalidValue, "%s: unknown copy kind %d", call, (int)kind);
  if (count && (!dst || !src)) return fail(orErrorInvalidValue, "%s: NULL pointer", call);
  bool srcDevice = kind == orMemcpyDeviceToHost || kind == orMemcpyDeviceToDevice;
  bool dstDevice = kind == orMemcpyHostToDevice || kind == orMemcpyDeviceToDevice;
  if (count && srcDevice && !isDeviceMemory(src, count))
    return fail(orErrorInvalidValue, "%s: source %p + %zu bytes is not inside openreg memory", call,
                src, count);
  if (count && dstDevice && !isDeviceMemory(dst, count))
    return fail(orErrorInvalidValue, "%s: destination %p + %zu bytes is not inside openreg memory",
                call, dst, count);
  return orSuccess;
}

// A side of a batched copy: false when it is inside device memory but runs past its segment.
bool fitsIfDevice(const void* ptr, size_t count, bool* device) {
  openreg::Region r;
  *device = openreg::findRegion(ptr, &r);
  return !*device || count <= r.size - ((uintptr_t)ptr - r.base);
}

}  // namespace

namespace openreg {

orError_t resolveStream(orStream_t stream, const char* call, orStream_t* out) {
  if (orError_t err = checkNotForked(call)) return err;
  if (!stream) {
    int device = currentDevice();
    if (orError_t err = checkDevice(device, call)) return err;
    *out = defaultStream(device);
    return orSuccess;
  }
  std::lock_guard<std::mutex> lock(table().mutex);
  if (!table().live.count(stream))
    return fail(orErrorInvalidResourceHandle, "%s: %p is not a live stream (destroyed?)", call,
                (void*)stream);
  *out = stream;
  return orSuccess;
}

void enqueue(orStream_t s, std::function<void()> task, std::function<void()> after) {
  std::lock_guard<std::mutex> lock(s->mutex);
  s->queue.emplace_back(std::move(task), std::move(after));
  s->enqueued++;
  s->workReady.notify_one();
}

orError_t synchronizeStream(orStream_t s, const char* call) {
  if (std::this_thread::get_id() == s->worker.get_id())
    return fail(orErrorInvalidValue,
                "%s: called from work running on the same stream; it would wait for itself", call);
  std::unique_lock<std::mutex> lock(s->mutex);
  uint64_t target = s->enqueued;
  s->workDone.wait(lock, [&] { return s->completed >= target; });
  return orSuccess;
}

void drainDevice(int device) {
  std::vector<std::shared_ptr<orStream>> streams;
  {
    std::lock_guard<std::mutex> lock(table().mutex);
    for (auto& [ptr, owner] : table().live)
      if (ptr->device == device && ptr->worker.get_id() != std::this_thread::get_id())
        streams.push_back(owner);
  }
  for (auto& s : streams) synchronizeStream(s.get(), "drainDevice");
}

}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orStreamCreate(orStream_t* stream) {
  if (!stream) return fail(orErrorInvalidValue, "orStreamCreate: stream is NULL");
  int device = currentDevice();
  if (orError_t err = checkDevice(device, "orStreamCreate")) return err;
  if (orError_t err = checkNotForked("orStreamCreate")) return err;
  std::lock_guard<std::mutex> lock(table().mutex);
  *stream = createLocked(device, table().nextId[device]++);
  return orSuccess;
}

orError_t orStreamDestroy(orStream_t stream) {
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamDestroy", &s)) return err;
  if (orError_t err = synchronizeStream(s, "orStreamDestroy")) return err;
  if (s->id == 0) return orSuccess;  // default streams live as long as the process
  std::shared_ptr<orStream> owner;
  {
    std::lock_guard<std::mutex> lock(table().mutex);
    auto it = table().live.find(s);
    if (it == table().live.end()) return orSuccess;  // another thread destroyed it meanwhile
    owner = std::move(it->second);
    table().live.erase(it);
    table().byId.erase({s->device, s->id});
  }
  {
    std::lock_guard<std::mutex> lock(s->mutex);
    s->stopping = true;
    s->workReady.notify_one();
  }
  s->worker.join();  // the worker drains anything enqueued after the synchronize above
  return orSuccess;
}

orError_t orStreamSynchronize(orStream_t stream) {
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamSynchronize", &s)) return err;
  return synchronizeStream(s, "orStreamSynchronize");
}

orError_t orStreamQuery(orStream_t stream) {
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamQuery", &s)) return err;
  std::lock_guard<std::mutex> lock(s->mutex);
  return s->completed == s->enqueued ? orSuccess : orErrorNotReady;
}

orError_t orStreamGetDevice(orStream_t stream, int* device) {
  if (!device) return fail(orErrorInvalidValue, "orStreamGetDevice: device is NULL");
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamGetDevice", &s)) return err;
  *device = s->device;
  return orSuccess;
}

orError_t orStreamGetId(orStream_t stream, int64_t* id) {
  if (!id) return fail(orErrorInvalidValue, "orStreamGetId: id is NULL");
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orStreamGetId", &s)) return err;
  *id = s->id;
  return orSuccess;
}

orError_t orStreamFromId(int device, int64_t id, orStream_t* stream) {
  if (!stream) return fail(orErrorInvalidValue, "orStreamFromId: stream is NULL");
  if (orError_t err = checkDevice(device, "orStreamFromId")) return err;
  if (orError_t err = checkNotForked("orStreamFromId")) return err;
  if (id == 0) {
    *stream = defaultStream(device);
    return orSuccess;
  }
  std::lock_guard<std::mutex> lock(table().mutex);
  auto it = table().byId.find({device, id});
  if (it == table().byId.end())
    return fail(orErrorInvalidResourceHandle,
                "orStreamFromId: device %d has no stream with id %lld", device, (long long)id);
  *stream = it->second;
  return orSuccess;
}

orError_t orLaunchHostFunc(orStream_t stream, orHostFn_t fn, void* user_data) {
  if (!fn) return fail(orErrorInvalidValue, "orLaunchHostFunc: fn is NULL");
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orLaunchHostFunc", &s)) return err;
  enqueue(s, [fn, user_data] { fn(user_data); });
  return orSuccess;
}

orError_t orDeviceSynchronize(void) {
  int device = currentDevice();
  if (orError_t err = checkDevice(device, "orDeviceSynchronize")) return err;
  if (orError_t err = checkNotForked("orDeviceSynchronize")) return err;
  std::vector<std::shared_ptr<orStream>> streams;
  {
    std::lock_guard<std::mutex> lock(table().mutex);
    for (auto& [ptr, owner] : table().live)
      if (ptr->device == device) streams.push_back(owner);
  }
  for (auto& s : streams)
    if (orError_t err = synchronizeStream(s.get(), "orDeviceSynchronize")) return err;
  return orSuccess;
}

orError_t orMemcpy(void* dst, const void* src, size_t count, orMemcpyKind kind) {
  if (orError_t err = checkCopy("orMemcpy", dst, src, count, kind)) return err;
  orStream_t s;
  if (orError_t err = resolveStream(nullptr, "orMemcpy", &s)) return err;
  if (orError_t err = synchronizeStream(s, "orMemcpy")) return err;
  if (count) memmove(dst, src, count);
  return orSuccess;
}

orError_t orMemcpyAsync(void* dst, const void* src, size_t count, orMemcpyKind kind,
                        orStream_t stream) {
  if (orError_t err = checkCopy("orMemcpyAsync", dst, src, count, kind)) return err;
  orStream_t s;
  if (orError_t err = resolveStream(stream, "orMemcpyAsync", &s)) return err;
  if (count) enqueue(s, [dst, src, count] { memmove(dst, src, count); });
  return orSuccess;
}

orError_t orMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes,
                             size_t count, orStream_t stream) {
  const char* call = "orMemcpyBatchAsync";
  if (count && (!dsts || !srcs || !sizes))
    return fail(orErrorInvalidValue, "%s: NULL array for %zu copies", call, count);
  struct Copy {
    void* dst;
    const void* src;
    size_t size;
  };
  std::vector<Copy> copies;
  copies.reserve(count);
  for (size_t i = 0; i < count; i++) {
    if (!sizes[i]) continue;
    if (!dsts[i] || !srcs[i])
      return fail(orErrorInvalidValue, "%s: copy %zu: NULL pointer", call, i);
    bool dstDevice, srcDevice;
    if (!fitsIfDevice(dsts[i], sizes[i], &dstDevice))
      return fail(orErrorInvalidValue,
                  "%s: copy %zu: destination %p + %zu bytes runs past its "
                  "openreg segment",
                  call, i, dsts[i], sizes[i]);
    if (!fitsIfDevice(srcs[i], sizes[i], &srcDevice))
      return fail(orErrorInvalidValue,
                  "%s: copy %zu: source %p + %zu bytes runs past its openreg "
                  "segment",
                  call, i, srcs[i], sizes[i]);
    if (!dstDevice && !srcDevice)
      return fail(orErrorInvalidValue,
                  "%s: copy %zu: neither destination %p nor source %p is "
                  "inside openreg memory",
                  call, i, dsts[i], srcs[i]);
    copies.push_back({dsts[i], srcs[i], sizes[i]});
  }
  orStream_t s;
  if (orError_t err = resolveStream(stream, call, &s)) return err;
  if (!copies.empty())
    enqueue(s, [copies = std::move(copies)] {
      for (const Copy& c : copies) memmove(c.dst, c.src, c.size);
    });
  return orSuccess;
}

}  // extern "C"
