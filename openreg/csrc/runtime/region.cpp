// Regions: the mappings that hold device memory (our segments and imported IPC mappings), the
// memfds behind segments, and pointer attributes resolved against them.
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <map>
#include <shared_mutex>

#include "internal.h"

using openreg::fail;

namespace {

struct RegionTable {
  std::shared_mutex mutex;
  std::map<uintptr_t, openreg::Region> byBase;
};

RegionTable& regions() {
  static RegionTable* t = new RegionTable();
  return *t;
}

orError_t randomToken(const char* call, unsigned char* token) {
  size_t got = 0;
  while (got < openreg::kTokenSize) {
    ssize_t n = getrandom(token + got, openreg::kTokenSize - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return fail(orErrorOsCall, "%s: getrandom failed: %s", call, openreg::osError(errno));
    got += (size_t)n;
  }
  return orSuccess;
}

}  // namespace

namespace openreg {

void registerRegion(const Region& region) {
  std::unique_lock<std::shared_mutex> lock(regions().mutex);
  regions().byBase[region.base] = region;
}

void unregisterRegion(uintptr_t base) {
  std::unique_lock<std::shared_mutex> lock(regions().mutex);
  regions().byBase.erase(base);
}

bool findRegion(const void* ptr, Region* out) {
  uintptr_t p = (uintptr_t)ptr;
  std::shared_lock<std::shared_mutex> lock(regions().mutex);
  auto& map = regions().byBase;
  auto it = map.upper_bound(p);
  if (it == map.begin()) return false;
  --it;
  if (p - it->second.base >= it->second.size) return false;
  if (out) *out = it->second;
  return true;
}

void tokenHex(const unsigned char* token, char out[2 * kTokenSize + 1]) {
  for (size_t i = 0; i < kTokenSize; i++) snprintf(out + 2 * i, 3, "%02x", token[i]);
}

orError_t createSharedFile(const char* call, const char* tag, size_t size, SharedFile* out) {
  SharedFile file;
  if (orError_t err = randomToken(call, file.token)) return err;
  char hex[2 * kTokenSize + 1];
  tokenHex(file.token, hex);
  char name[96];
  snprintf(name, sizeof(name), "openreg:%s:%s", tag, hex);
  // A memfd has no name in any filesystem: nothing can leak in /dev/shm, even on SIGKILL.
  file.fd = memfd_create(name, MFD_CLOEXEC);
  if (file.fd < 0)
    return fail(errno == EMFILE || errno == ENFILE ? orErrorMemoryAllocation : orErrorOsCall,
                "%s: memfd_create failed: %s (each segment holds one fd; raise `ulimit -n`?)", call,
                osError(errno));
  if (ftruncate(file.fd, (off_t)size) != 0) {
    int e = errno;
    close(file.fd);
    return fail(orErrorMemoryAllocation, "%s: cannot size a %zu-byte segment: %s", call, size,
                osError(e));
  }
  file.base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd, 0);
  if (file.base == MAP_FAILED) {
    int e = errno;
    close(file.fd);
    return fail(orErrorMemoryAllocation, "%s: cannot map a %zu-byte segment: %s", call, size,
                osError(e));
  }
  file.size = size;
  *out = file;
  return orSuccess;
}

}  // namespace openreg

extern "C" orError_t orPointerGetAttributes(orPointerAttributes* attributes, const void* ptr) {
  if (!attributes) return fail(orErrorInvalidValue, "orPointerGetAttributes: attributes is NULL");
  openreg::Region r;
  if (!openreg::findRegion(ptr, &r)) {
    uintptr_t base = 0;
    size_t size = 0;
    if (openreg::findHostBlock(ptr, &base, &size))
      *attributes = orPointerAttributes{orMemoryTypeHost, -1, (void*)base, size,
                                        (size_t)((uintptr_t)ptr - base)};
    else
      *attributes = orPointerAttributes{orMemoryTypeUnregistered, -1, nullptr, 0, 0};
    return orSuccess;
  }
  *attributes = orPointerAttributes{orMemoryTypeDevice, r.device, (void*)r.base, r.size,
                                    (size_t)((uintptr_t)ptr - r.base)};
  return orSuccess;
}
