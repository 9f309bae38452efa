// IPC memory: exporting a segment as handle bytes, opening it in another process (refcounted per
// segment), and the checks that make a forged, stale or orphaned handle fail cleanly.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <string>

#include "ipc_handle.h"

namespace openreg {

namespace {

constexpr uint32_t kMagic = 0x5049524f;  // "ORIP"
constexpr uint16_t kVersion = 1;

// Imported segments, keyed by token: opening the same segment twice gives the same mapping.
struct Import {
  void* base;
  size_t size;
  int device;
  int refs;
};
struct ImportTable {
  std::mutex mutex;
  std::map<std::string, Import> byToken;
  std::map<uintptr_t, std::string> tokenOf;  // base -> token
};

ImportTable& imports() {
  static ImportTable* t = new ImportTable();
  return *t;
}

orError_t peerGone(const char* call, pid_t pid) {
  return fail(orErrorPeerGone,
              "%s: process %d that exported this handle has exited, and its memory with it. Keep "
              "the producer alive until consumers have opened what it shares.",
              call, (int)pid);
}

}  // namespace

// Exists (kill does not say ESRCH) and is not a zombie or dying (state Z or X after the last ')'
// of /proc/<pid>/stat): an exited process holds no fds even before its parent reaps it.
bool processAlive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno != EPERM) return false;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  FILE* f = fopen(path, "re");
  if (!f) return true;  // no procfs view: trust kill()
  char buf[512];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char* paren = strrchr(buf, ')');  // the state follows the (possibly odd) command name
  return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

HandleData newHandle(HandleKind kind, pid_t pid, int fd, uint64_t size,
                     const unsigned char* token) {
  HandleData h;
  memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.version = kVersion;
  h.kind = kind;
  h.pid = pid;
  h.fd = fd;
  h.size = size;
  h.physical = -1;
  h.slot = -1;
  memcpy(h.token, token, kTokenSize);
  return h;
}

orError_t decodeHandle(const unsigned char* bytes, HandleKind kind, const char* call,
                       HandleData* out) {
  HandleData h;
  memcpy(&h, bytes, sizeof(h));
  const char* what = kind == kMemHandle ? "memory" : "event";
  if (h.magic != kMagic)
    return fail(orErrorInvalidHandle, "%s: not an openreg IPC handle (bad magic 0x%08x)", call,
                h.magic);
  if (h.version != kVersion)
    return fail(orErrorInvalidHandle, "%s: handle version %u, this runtime reads version %u", call,
                h.version, kVersion);
  if (h.kind != kind)
    return fail(orErrorInvalidHandle, "%s: expected an IPC %s handle, got kind %u", call, what,
                h.kind);
  bool zero = true;
  for (unsigned char c : h.zero) zero = zero && c == 0;
  if (!zero || h.pid <= 0 || h.fd < 0 || h.size == 0 || (h.size & 4095) != 0)
    return fail(orErrorInvalidHandle, "%s: corrupted %s handle (pid %d, fd %d, size %llu)", call,
                what, h.pid, h.fd, (unsigned long long)h.size);
  *out = h;
  return orSuccess;
}

// Steps 2-4 of the open procedure of docs/ipc-handles.md; src/devipc/_memfd.py follows the same
// steps. On success *out is an fd of exactly the memfd the handle names, for the caller to close.
orError_t openPeerFile(const HandleData& h, const char* call, int* out) {
  if (!processAlive(h.pid)) return peerGone(call, h.pid);
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (!processAlive(h.pid)) return peerGone(call, h.pid);
    if (e == EACCES || e == EPERM)
      // No error code of its own (yet): the message names the rules, the code says "this handle
      // cannot be opened here".
      return fail(orErrorInvalidHandle,
                  "%s: permission denied opening %s: the importer must run as the same user as "
                  "process %d, in the same PID namespace, and process %d must be dumpable (one "
                  "that dropped privileges or called prctl(PR_SET_DUMPABLE, 0) cannot be opened "
                  "even by its own user)",
                  call, path, h.pid, h.pid);
    if (e == EMFILE || e == ENFILE || e == ENOMEM)
      return fail(orErrorOsCall, "%s: cannot open %s: %s", call, path, osError(e));
    if (e == ENOENT)
      return fail(orErrorInvalidHandle,
                  "%s: fd %d is no longer open in process %d: the memory was released there "
                  "(freed and orEmptyCache) or the handle is stale",
                  call, h.fd, h.pid);
    return fail(orErrorInvalidHandle,
                "%s: fd %d of process %d cannot be opened as memory (%s): the handle is forged or "
                "stale",
                call, h.fd, h.pid, osError(e));
  }
  // Check what was actually opened, not the path again: the exporter may reuse fd numbers. The
  // whole link name, tag included (the physical device of a segment, "progress" for an event
  // page): a regular file that merely carries the token in its name is not a memfd, and a forged
  // kind or device must not map the right token as the wrong thing.
  char self[64], link[256];
  snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(self, link, sizeof(link) - 1);
  link[n > 0 ? n : 0] = '\0';
  char hex[2 * kTokenSize + 1];
  tokenHex(h.token, hex);
  char expected[128];
  if (h.kind == kMemHandle)
    snprintf(expected, sizeof(expected), "/memfd:openreg:%d:%s (deleted)", (int)h.physical, hex);
  else
    snprintf(expected, sizeof(expected), "/memfd:openreg:progress:%s (deleted)", hex);
  struct stat st;
  bool sameFile = strcmp(link, expected) == 0;
  if (!sameFile || fstat(fd, &st) != 0 || (uint64_t)st.st_size != h.size) {
    close(fd);
    return fail(orErrorInvalidHandle,
                "%s: fd %d of process %d is not the memory this handle names (name, token or "
                "size mismatch): the handle is forged or stale",
                call, h.fd, h.pid);
  }
  *out = fd;
  return orSuccess;
}

orError_t mapPeerFile(const HandleData& h, const char* call, void** base) {
  int fd = -1;
  if (orError_t err = openPeerFile(h, call, &fd)) return err;
  void* p = mmap(nullptr, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (p == MAP_FAILED)
    return fail(orErrorMemoryAllocation, "%s: cannot map %llu bytes from process %d: %s", call,
                (unsigned long long)h.size, h.pid, osError(e));
  *base = p;
  return orSuccess;
}

}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orIpcGetMemHandle(orIpcMemHandle_t* handle, size_t* offset, const void* ptr) {
  if (!handle || !offset) return fail(orErrorInvalidValue, "orIpcGetMemHandle: NULL argument");
  Region r;
  if (!findRegion(ptr, &r))
    return fail(orErrorInvalidValue, "orIpcGetMemHandle: %p is not openreg device memory", ptr);
  // An imported region names the original exporter's memfd, so received memory can be re-shared.
  HandleData h = newHandle(kMemHandle, r.pid, r.fd, r.size, r.token);
  h.physical = r.physical;
  memcpy(handle->reserved, &h, sizeof(h));
  *offset = (uintptr_t)ptr - r.base;
  return orSuccess;
}

orError_t orIpcOpenMemHandle(void** base, size_t* size, int* device, orIpcMemHandle_t handle) {
  const char* call = "orIpcOpenMemHandle";
  if (!base || !size || !device) return fail(orErrorInvalidValue, "%s: NULL argument", call);
  HandleData h{};
  if (orError_t err = decodeHandle(handle.reserved, kMemHandle, call, &h)) return err;
  if (h.physical < 0)
    return fail(orErrorInvalidHandle, "%s: corrupted memory handle (physical device %d)", call,
                h.physical);
  int local = localIndex(h.physical);
  if (local < 0) {
    // A hidden device and a forged device field look alike: the memfd's name, which carries the
    // physical index, tells them apart (a forged one is an invalid handle, like any other forgery).
    int fd = -1;
    if (orError_t err = openPeerFile(h, call, &fd)) return err;
    close(fd);
    return fail(orErrorInvalidDevice,
                "%s: the memory lives on physical device %d, which OPENREG_VISIBLE_DEVICES hides "
                "in this process (or OPENREG_DEVICE_COUNT is smaller here)",
                call, h.physical);
  }
  std::string token((const char*)h.token, kTokenSize);
  std::lock_guard<std::mutex> lock(imports().mutex);
  auto it = imports().byToken.find(token);
  if (it == imports().byToken.end()) {
    void* p = nullptr;
    if (orError_t err = mapPeerFile(h, call, &p)) return err;
    Region r;
    r.base = (uintptr_t)p;
    r.size = h.size;
    r.device = local;
    r.physical = h.physical;
    r.imported = true;
    r.pid = h.pid;
    r.fd = h.fd;
    memcpy(r.token, h.token, kTokenSize);
    registerRegion(r);
    it = imports().byToken.emplace(token, Import{p, h.size, local, 0}).first;
    imports().tokenOf[r.base] = token;
  } else if (it->second.size != h.size || it->second.device != local)
    return fail(orErrorInvalidHandle,
                "%s: the handle's size or device does not match the segment its token names: the "
                "handle is forged",
                call);
  it->second.refs++;
  *base = it->second.base;
  *size = it->second.size;
  *device = it->second.device;
  return orSuccess;
}

orError_t orIpcCloseMemHandle(void* base) {
  Import last{};
  {
    std::lock_guard<std::mutex> lock(imports().mutex);
    auto t = imports().tokenOf.find((uintptr_t)base);
    if (t == imports().tokenOf.end())
      return fail(orErrorInvalidValue,
                  "orIpcCloseMemHandle(%p): not a base returned by orIpcOpenMemHandle (or closed "
                  "more often than opened)",
                  base);
    Import& imp = imports().byToken.at(t->second);
    if (--imp.refs > 0) return orSuccess;
    last = imp;
    unregisterRegion((uintptr_t)base);
    imports().byToken.erase(t->second);
    imports().tokenOf.erase(t);
  }
  // Queued copies may still read or write the mapping: unmap only after they ran. Outside the
  // lock, since that work may itself close a handle.
  drainDevice(last.device);
  munmap(last.base, last.size);
  return orSuccess;
}

}  // extern "C"
