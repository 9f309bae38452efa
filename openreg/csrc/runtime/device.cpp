// Devices: how many, which are visible, their stable identity, the current one per thread.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "internal.h"

namespace {

constexpr int kDefaultCount = 2;
constexpr int kMaxCount = 1024;

// Read once. A value that makes no sense is refused rather than guessed around: `error` then says
// which variable and value, every call that names a device fails with it, and no device is
// visible. OPENREG_DEVICE_COUNT must be an integer in [0, kMaxCount]; OPENREG_VISIBLE_DEVICES a
// comma-separated list of distinct physical indices below that count (spaces around entries
// allowed). An empty OPENREG_VISIBLE_DEVICES hides every device, as CUDA_VISIBLE_DEVICES does.
struct DeviceTable {
  std::vector<int> physical;  // local index -> physical index
  std::string error;          // why the environment was refused; empty if it was not

  DeviceTable() {
    int count = kDefaultCount;
    // The environment is read once, as the table is built (a static of the first caller).
    if (const char* env = getenv("OPENREG_DEVICE_COUNT")) {  // NOLINT(concurrency-mt-unsafe)
      long value = 0;
      if (!parseIndex(env, &value) || value > kMaxCount) {
        refuse("OPENREG_DEVICE_COUNT", env, "an integer from 0 to 1024");
        return;
      }
      count = (int)value;
    }
    const char* visible = getenv("OPENREG_VISIBLE_DEVICES");  // NOLINT(concurrency-mt-unsafe)
    if (visible == nullptr) {
      for (int i = 0; i < count; i++) physical.push_back(i);
    } else if (*visible != '\0') {
      std::string list(visible);
      size_t pos = 0;
      while (pos <= list.size()) {
        size_t comma = list.find(',', pos);
        if (comma == std::string::npos) comma = list.size();
        std::string entry = list.substr(pos, comma - pos);
        pos = comma + 1;
        long value = 0;
        bool seen = false;
        bool ok = parseIndex(entry.c_str(), &value) && value < count;
        for (int p : physical) seen = seen || p == value;
        if (!ok || seen) {
          char expected[160];
          snprintf(expected, sizeof(expected),
                   "distinct device indices from 0 to %d, separated "
                   "by commas (entry '%.16s' %s)",
                   count - 1, entry.c_str(), ok ? "repeats an earlier one" : "is not one of them");
          physical.clear();
          refuse("OPENREG_VISIBLE_DEVICES", visible, expected);
          return;
        }
        physical.push_back((int)value);
      }
    }
    raiseFileLimit();
  }

  // A decimal integer >= 0, spaces around it allowed.
  static bool parseIndex(const char* text, long* value) {
    char* end = nullptr;
    while (*text == ' ' || *text == '\t') text++;
    if (*text < '0' || *text > '9') return false;
    *value = strtol(text, &end, 10);
    while (*end == ' ' || *end == '\t') end++;
    return *end == '\0' && *value <= INT32_MAX;
  }

  void refuse(const char* name, const char* value, const char* expected) {
    char message[512];
    snprintf(message, sizeof(message), "%s='%.200s' is not valid: expected %s", name, value,
             expected);
    error = message;
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

// Whether this process used the runtime (an orRuntimeState). The first use registers a fork
// handler that marks a child forked afterwards: it has no stream workers, and its allocator cache
// would hand out memory the parent still uses. An atomic load is all a call then costs.
std::atomic<int> state{orRuntimeUnused};
pid_t firstUser = 0;  // the process that used it first, for the message

void markForkedChild() {
  if (state.load() != orRuntimeUnused) state.store(orRuntimeForkedAfterUse);
}

// Stable across processes and renumbering: the physical index is the only input.
void formatUuid(int physical, char out[37]) {
  snprintf(out, 37, "6f70656e-7265-4767-8000-%012x", (unsigned)physical);
}

}  // namespace

namespace openreg {

int deviceCount() {
  return (int)table().physical.size();
}
bool validDevice(int device) {
  return device >= 0 && device < deviceCount();
}
int physicalIndex(int device) {
  return table().physical[device];
}

int localIndex(int physical) {
  const auto& p = table().physical;
  for (size_t i = 0; i < p.size(); i++)
    if (p[i] == physical) return (int)i;
  return -1;
}

int currentDevice() {
  return current;
}

// Like CUDA, the runtime cannot be used in a child forked after its first use. Counting devices is
// no use (CUDA's NVML-based count is not either), so a parent that only counted forks good
// children; device queries and frees stay allowed, so inherited objects can still be torn down.
orError_t checkNotForked(const char* call) {
  int now = state.load(std::memory_order_acquire);
  if (now == orRuntimeUnused) {
    static std::once_flag once;  // untouched in a child forked before any use: it may use its own
    std::call_once(once, [] {
      firstUser = getpid();
      pthread_atfork(nullptr, nullptr, &markForkedChild);
      state.store(orRuntimeInitialized, std::memory_order_release);
    });
    now = state.load(std::memory_order_acquire);
  }
  if (now == orRuntimeInitialized) return orSuccess;
  // CUDA's wording, so users recognise the cause and the fix.
  return fail(orErrorInitialization,
              "%s: Cannot re-initialize openreg in forked subprocess. To use openreg with "
              "multiprocessing, you must use the 'spawn' start method (openreg was first used in "
              "process %d, which forked this one afterwards)",
              call, (int)firstUser);
}

orError_t checkEnvironment(const char* call) {
  if (table().error.empty()) return orSuccess;
  return fail(orErrorInvalidEnvironment, "%s: %s", call, table().error.c_str());
}

orError_t checkDevice(int device, const char* call) {
  if (orError_t err = checkEnvironment(call)) return err;
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
  return checkEnvironment("orGetDeviceCount");
}

orError_t orGetDevice(int* device) {
  if (!device) return fail(orErrorInvalidValue, "orGetDevice: device is NULL");
  if (orError_t err = checkDevice(current, "orGetDevice")) return err;
  if (orError_t err = checkNotForked("orGetDevice")) return err;
  *device = current;
  return orSuccess;
}

orError_t orSetDevice(int device) {
  if (orError_t err = checkDevice(device, "orSetDevice")) return err;
  if (orError_t err = checkNotForked("orSetDevice")) return err;
  current = device;
  return orSuccess;
}

orError_t orGetRuntimeState(orRuntimeState* out) {
  if (!out) return fail(orErrorInvalidValue, "orGetRuntimeState: state is NULL");
  *out = (orRuntimeState)state.load();
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
