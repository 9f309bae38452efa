// Devices: how many, which are visible, their stable identity, the current one per thread.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "internal.h"

namespace {

constexpr int kDefaultCount = 2;
constexpr int kMaxCount = 1024;

// Read once. Bad values are ignored rather than fatal: an unparsable or out-of-range
// OPENREG_DEVICE_COUNT gives the default; in OPENREG_VISIBLE_DEVICES every entry that is not a
// physical index in range, or repeats one, is skipped (CUDA stops at the first bad entry instead).
// An empty OPENREG_VISIBLE_DEVICES hides every device, as CUDA_VISIBLE_DEVICES does.
struct DeviceTable {
  std::vector<int> physical;  // local index -> physical index
  pid_t owner = getpid();     // a forked child inherits the tables but not the stream workers

  DeviceTable() {
    int count = kDefaultCount;
    if (const char* env = getenv("OPENREG_DEVICE_COUNT")) {
      char* end = nullptr;
      long value = strtol(env, &end, 10);
      if (end != env && *end == '\0' && value >= 0 && value <= kMaxCount) count = (int)value;
    }
    const char* visible = getenv("OPENREG_VISIBLE_DEVICES");
    if (visible == nullptr) {
      for (int i = 0; i < count; i++) physical.push_back(i);
    } else {
      std::string list(visible);
      size_t pos = 0;
      while (pos <= list.size()) {
        size_t comma = list.find(',', pos);
        if (comma == std::string::npos) comma = list.size();
        std::string entry = list.substr(pos, comma - pos);
        pos = comma + 1;
        char* end = nullptr;
        long value = strtol(entry.c_str(), &end, 10);
        while (end && (*end == ' ' || *end == '\t')) end++;
        bool parsed = !entry.empty() && end != entry.c_str() && *end == '\0';
        if (!parsed || value < 0 || value >= count) continue;
        bool seen = false;
        for (int p : physical) seen = seen || p == value;
        if (!seen) physical.push_back((int)value);
      }
    }
    raiseFileLimit();
  }

  // Every live segment holds an fd, so a busy process can need many more than the usual 1024.
  static void raiseFileLimit() {
    struct rlimit limit;
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
      limit.rlim_cur = limit.rlim_max;
      setrlimit(RLIMIT_NOFILE, &limit);
    }
  }
};

const DeviceTable& table() {
  static const DeviceTable* t = new DeviceTable();
  return *t;
}

thread_local int current = 0;

// Stable across processes and renumbering: the physical index is the only input.
void formatUuid(int physical, char out[37]) {
  snprintf(out, 37, "6f70656e-7265-4767-8000-%012x", (unsigned)physical);
}

}  // namespace

namespace openreg {

int deviceCount() { return (int)table().physical.size(); }
bool validDevice(int device) { return device >= 0 && device < deviceCount(); }
int physicalIndex(int device) { return table().physical[device]; }

int localIndex(int physical) {
  const auto& p = table().physical;
  for (size_t i = 0; i < p.size(); i++)
    if (p[i] == physical) return (int)i;
  return -1;
}

int currentDevice() { return current; }

// Like CUDA, the runtime cannot be used in a child forked after its first use: the child has no
// stream workers, and its allocator cache would hand out memory the parent still uses. Device
// queries and frees stay allowed, so inherited objects can still be torn down.
orError_t checkNotForked(const char* call) {
  if (getpid() == table().owner) return orSuccess;
  // CUDA's wording, so users recognise the cause and the fix.
  return fail(orErrorInitialization,
              "%s: Cannot re-initialize openreg in forked subprocess. To use openreg with "
              "multiprocessing, you must use the 'spawn' start method (openreg was first used in "
              "process %d, which forked this one afterwards)",
              call, (int)table().owner);
}

orError_t checkDevice(int device, const char* call) {
  if (validDevice(device)) return orSuccess;
  return fail(orErrorInvalidDevice,
              "%s: device %d does not exist here (%d visible; see OPENREG_DEVICE_COUNT and "
              "OPENREG_VISIBLE_DEVICES)",
              call, device, deviceCount());
}

}  // namespace openreg

using namespace openreg;

extern "C" {

orError_t orGetDeviceCount(int* count) {
  if (!count) return fail(orErrorInvalidValue, "orGetDeviceCount: count is NULL");
  *count = deviceCount();
  return orSuccess;
}

orError_t orGetDevice(int* device) {
  if (!device) return fail(orErrorInvalidValue, "orGetDevice: device is NULL");
  if (orError_t err = checkDevice(current, "orGetDevice")) return err;
  *device = current;
  return orSuccess;
}

orError_t orSetDevice(int device) {
  if (orError_t err = checkDevice(device, "orSetDevice")) return err;
  current = device;
  return orSuccess;
}

orError_t orDeviceGetUuid(int device, char* uuid, size_t len) {
  if (orError_t err = checkDevice(device, "orDeviceGetUuid")) return err;
  if (!uuid || len < 37)
    return fail(orErrorInvalidValue, "orDeviceGetUuid: need a buffer of at least 37 bytes");
  formatUuid(physicalIndex(device), uuid);
  return orSuccess;
}

orError_t orDeviceGetByUuid(const char* uuid, int* device) {
  if (!uuid || !device) return fail(orErrorInvalidValue, "orDeviceGetByUuid: NULL argument");
  char candidate[37];
  for (int i = 0; i < deviceCount(); i++) {
    formatUuid(physicalIndex(i), candidate);
    if (strcasecmp(candidate, uuid) == 0) {
      *device = i;
      return orSuccess;
    }
  }
  return fail(orErrorInvalidDevice, "orDeviceGetByUuid: no visible device has UUID '%.64s'", uuid);
}

}  // extern "C"
