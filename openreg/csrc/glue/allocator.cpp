// The PrivateUse1 allocator: every torch storage on openreg is runtime memory (orMalloc), hence
// shareable with other processes. Deriving from c10::DeviceAllocator is what makes
// torch.accelerator.memory_allocated() and friends report the runtime's statistics.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>

#include "common.h"

namespace devipc::openreg {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::StatType;

void free_device_memory(void* ptr) {
  // A deleter must not throw; a failing orFree means the pointer was not ours: a bug worth a crash.
  const orError_t err = orFree(ptr);
  TORCH_INTERNAL_ASSERT(err == orSuccess, "openreg: orFree failed: ", orGetErrorString(err), " (",
                        orGetLastErrorMessage(), ")");
}

orMemStats runtime_stats(c10::DeviceIndex device) {
  orMemStats stats{};
  OR_CHECK(orMemGetStats(device, &stats));
  return stats;
}

struct OpenRegAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    int device = 0;
    OR_CHECK(orGetDevice(&device));
    void* ptr = nullptr;
    const orError_t err = orMalloc(&ptr, nbytes);
    // Only a real shortage is an OutOfMemoryError (callers catch it to free memory and retry);
    // anything else, a forked child say, is a plain error with the runtime's message.
    TORCH_CHECK(err == orSuccess || err == orErrorMemoryAllocation, "openreg: allocating ", nbytes,
                " bytes on openreg:", device, " failed: ", orGetErrorString(err), " (",
                orGetLastErrorMessage(), ")");
    if (err != orSuccess) {
      const orMemStats stats = runtime_stats(device);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "openreg: allocating ", nbytes,
                       " bytes on openreg:", device, " failed: ", orGetErrorString(err), " (",
                       orGetLastErrorMessage(), "); allocated ", stats.allocated,
                       " bytes, reserved ", stats.reserved,
                       "; torch.openreg.empty_cache() returns unused segments");
    }
    return {ptr, ptr, &free_device_memory, c10::Device(kDeviceType, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_device_memory;
  }

  // Used by clone() of storages: blocking, after all work queued on the source's device.
  void copy_data(void* dest, const void* src, size_t count) const override {
    if (count == 0) return;
    orPointerAttributes attributes{};
    OR_CHECK(orPointerGetAttributes(&attributes, src));
    const c10::DeviceGuard guard(c10::Device(kDeviceType, attributes.device));
    OR_CHECK(orDeviceSynchronize());
    OR_CHECK(orMemcpy(dest, src, count, orMemcpyDeviceToDevice));
  }

  // The runtime initializes itself on first use: there is nothing to be uninitialized.
  bool initialized() override {
    return true;
  }

  // Frees cached segments of every device. Work still queued may use blocks freed just before, so
  // each device is synchronized first, as CUDA's emptyCache does.
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    for (c10::DeviceIndex device = 0; device < device_count(); ++device) {
      const c10::DeviceGuard guard(c10::Device(kDeviceType, device));
      OR_CHECK(orDeviceSynchronize());
      OR_CHECK(orEmptyCache(device));
    }
  }

  // The runtime's cache is not stream-aware: a block freed while another stream still uses it may
  // be handed out again. As with CUDA without recordStream, callers synchronize such streams first.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const orMemStats raw = runtime_stats(device);
    DeviceStats stats;
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    stats.allocated_bytes[all].current = static_cast<int64_t>(raw.allocated);
    stats.allocated_bytes[all].peak = static_cast<int64_t>(raw.peak_allocated);
    stats.active_bytes[all] = stats.allocated_bytes[all];  // no block is freed lazily
    stats.reserved_bytes[all].current = static_cast<int64_t>(raw.reserved);
    stats.reserved_bytes[all].peak = static_cast<int64_t>(raw.peak_reserved);
    stats.allocation[all].allocated = static_cast<int64_t>(raw.num_allocs);
    stats.allocation[all].freed = static_cast<int64_t>(raw.num_frees);
    stats.segment[all].current = static_cast<int64_t>(raw.num_segments);
    return stats;
  }

  // torch.accelerator.get_memory_info: (free, total) of the host memory all devices allocate in.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    size_t free = 0, total = 0;
    OR_CHECK(orMemGetInfo(checked_index(device), &free, &total));
    return {free, total};
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    OR_CHECK(orMemResetAccumulatedStats(device));
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    OR_CHECK(orMemResetPeakStats(device));
  }
};

OpenRegAllocator allocator;

}  // namespace

REGISTER_ALLOCATOR(kDeviceType, &allocator)

}  // namespace devipc::openreg
