// How torch sees openreg devices: the device guard (devices, streams, events), the PrivateUse1
// hooks (availability, pointers, generators) and the few device functions torch.openreg calls
// through torch.ops.devipc_openreg.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace devipc::openreg {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;

DeviceIndex device_count() noexcept {
  int count = 0;
  return orGetDeviceCount(&count) == orSuccess ? static_cast<DeviceIndex>(count) : 0;
}

DeviceIndex current_device() {
  int device = 0;
  OR_CHECK(orGetDevice(&device));
  return static_cast<DeviceIndex>(device);
}

DeviceIndex checked_index(int64_t index) {
  if (index < 0) return current_device();
  TORCH_CHECK(index < device_count(), "openreg: invalid device index ", static_cast<int>(index),
              "; ", static_cast<int>(device_count()),
              " devices are visible (see OPENREG_DEVICE_COUNT, OPENREG_VISIBLE_DEVICES)");
  return static_cast<DeviceIndex>(index);
}

// ---- streams ------------------------------------------------------------------------------------
// A c10 StreamId is the runtime's stream id, so a torch.Stream names the same stream in every
// thread and module. Each thread has its own current stream per device; 0 (default) until set.
constexpr size_t kMaxDevices = static_cast<size_t>(std::numeric_limits<DeviceIndex>::max()) + 1;
thread_local std::array<StreamId, kMaxDevices> current_stream_ids{};

orStream_t native_stream(const Stream& stream) {
  orStream_t native = nullptr;
  OR_CHECK(orStreamFromId(stream.device_index(), stream.id(), &native));
  return native;
}

Stream create_stream(DeviceIndex device) {
  const c10::DeviceGuard guard(Device(kDeviceType, device));  // orStreamCreate uses the current device
  orStream_t native = nullptr;
  OR_CHECK(orStreamCreate(&native));
  int64_t id = 0;
  OR_CHECK(orStreamGetId(native, &id));
  return Stream(Stream::UNSAFE, Device(kDeviceType, device), id);
}

// Each runtime stream is a worker thread, so pooled requests share a few streams round-robin, as
// CUDA's stream pool does; only getNewStream creates one per call.
Stream pooled_stream(DeviceIndex device) {
  constexpr size_t kPoolSize = 4;
  struct Pool {
    std::vector<StreamId> ids;
    size_t next = 0;
  };
  static std::mutex mutex;
  static std::unordered_map<DeviceIndex, Pool> pools;
  const std::lock_guard<std::mutex> lock(mutex);
  Pool& pool = pools[device];
  if (pool.ids.size() < kPoolSize) pool.ids.push_back(create_stream(device).id());
  const StreamId id = pool.ids[pool.next++ % pool.ids.size()];
  return Stream(Stream::UNSAFE, Device(kDeviceType, device), id);
}

bool ready(orError_t status) {
  if (status == orErrorNotReady) return false;
  OR_CHECK(status);
  return true;
}

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDeviceType;
  }

  Device exchangeDevice(Device device) const override {
    const Device previous = getDevice();
    if (previous.index() != device.index()) setDevice(device);
    return previous;
  }

  Device getDevice() const override {
    return Device(kDeviceType, current_device());
  }

  void setDevice(Device device) const override {
    TORCH_CHECK(device.type() == kDeviceType, "openreg: cannot set device ", device);
    OR_CHECK(orSetDevice(checked_index(device.index())));
  }

  void uncheckedSetDevice(Device device) const noexcept override {
    (void)orSetDevice(device.index());  // restores a device that was valid: cannot fail
  }

  Stream getStream(Device device) const override {
    const DeviceIndex index = checked_index(device.index());
    return Stream(Stream::UNSAFE, Device(kDeviceType, index), current_stream_ids[index]);
  }

  Stream getDefaultStream(Device device) const override {
    return Stream(Stream::DEFAULT, Device(kDeviceType, checked_index(device.index())));
  }

  Stream getStreamFromGlobalPool(Device device, bool /*isHighPriority*/) const override {
    return pooled_stream(checked_index(device.index()));  // the runtime has no priorities
  }

  Stream getNewStream(Device device, int /*priority*/) const override {
    return create_stream(checked_index(device.index()));
  }

  Stream exchangeStream(Stream stream) const override {
    StreamId& current = current_stream_ids[checked_index(stream.device_index())];
    const Stream previous(Stream::UNSAFE, stream.device(), current);
    current = stream.id();
    return previous;
  }

  void* getStreamNativeHandle(const Stream stream) const override {
    return native_stream(stream);
  }

  DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }

  bool queryStream(const Stream& stream) const override {
    return ready(orStreamQuery(native_stream(stream)));
  }

  void synchronizeStream(const Stream& stream) const override {
    OR_CHECK(orStreamSynchronize(native_stream(stream)));
  }

  void synchronizeDevice(const DeviceIndex device) const override {
    const c10::DeviceGuard guard(Device(kDeviceType, checked_index(device)));
    OR_CHECK(orDeviceSynchronize());
  }

  // Events are created lazily, on the device of the stream they are first recorded on.
  // EventFlag::BACKEND_DEFAULT is what torch.Event(enable_timing=True) asks for.
  void record(void** event, const Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "openreg: an event of openreg:", static_cast<int>(device_index),
                " cannot be recorded on a stream of openreg:",
                static_cast<int>(stream.device_index()));
    auto native = static_cast<orEvent_t>(*event);
    if (native == nullptr) {
      const c10::DeviceGuard guard(stream.device());
      const unsigned flags =
          flag == c10::EventFlag::BACKEND_DEFAULT ? orEventDefault : orEventDisableTiming;
      OR_CHECK(orEventCreateWithFlags(&native, flags));
      *event = native;
    }
    OR_CHECK(orEventRecord(native, native_stream(stream)));
  }

  void block(void* event, const Stream& stream) const override {
    if (event == nullptr) return;  // never recorded: nothing to wait for
    OR_CHECK(orStreamWaitEvent(native_stream(stream), static_cast<orEvent_t>(event), 0));
  }

  bool queryEvent(void* event) const override {
    return event == nullptr || ready(orEventQuery(static_cast<orEvent_t>(event)));
  }

  void synchronizeEvent(void* event) const override {
    if (event != nullptr) OR_CHECK(orEventSynchronize(static_cast<orEvent_t>(event)));
  }

  double elapsedTime(void* start, void* end, const DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "openreg: both events must be recorded before elapsed_time");
    float ms = 0;
    OR_CHECK(orEventElapsedTime(&ms, static_cast<orEvent_t>(start), static_cast<orEvent_t>(end)));
    return ms;
  }

  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override {
    if (event != nullptr) (void)orEventDestroy(static_cast<orEvent_t>(event));  // cannot throw here
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl)

// ---- generators ---------------------------------------------------------------------------------
// Random ops run as CPU kernels (the fallback in ops.cpp), so an openreg generator is a CPU
// generator bound to an openreg device; the fallback lends its state to the CPU kernel.
struct Generator final : at::CPUGeneratorImpl {
  explicit Generator(DeviceIndex device) {
    device_ = Device(kDeviceType, device);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

at::Generator new_generator(DeviceIndex device) {
  return at::make_generator<Generator>(checked_index(device));
}

// Seeded non-deterministically at first use, like CUDA's; torch.manual_seed reseeds them all.
at::Generator& default_generator(int64_t device) {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> all;
    for (DeviceIndex i = 0; i < device_count(); ++i) {
      all.push_back(new_generator(i));
      all.back().seed();
    }
    return all;
  }();
  return generators[checked_index(device)];
}

// ---- hooks --------------------------------------------------------------------------------------
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return device_count() > 0;
  }

  // The runtime has no per-device context to create: a visible device is ready.
  bool hasPrimaryContext(DeviceIndex device) const override {
    return device >= 0 && device < device_count();
  }

  DeviceIndex deviceCount() const override {
    return device_count();
  }

  DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  void setCurrentDevice(DeviceIndex device) const override {
    OR_CHECK(orSetDevice(checked_index(device)));
  }

  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    const DeviceIndex previous = current_device();
    if (device != previous) setCurrentDevice(device);
    return previous;
  }

  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  Device getDeviceFromPtr(void* data) const override {
    orPointerAttributes attributes{};
    OR_CHECK(orPointerGetAttributes(&attributes, data));
    TORCH_CHECK(attributes.type == orMemoryTypeDevice, "openreg: pointer ", data,
                " is not openreg device memory");
    return Device(kDeviceType, static_cast<DeviceIndex>(attributes.device));
  }

  // Non-blocking copies to the CPU ask for pinned memory. The runtime copies from and to any host
  // memory (there is no DMA engine to pin it for), so ordinary CPU memory serves.
  at::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
  }

  const at::Generator& getDefaultGenerator(DeviceIndex device) const override {
    return default_generator(device);
  }

  at::Generator getNewGenerator(DeviceIndex device) const override {
    return new_generator(device);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage, nbytes);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());  // lives as long as the process, like torch's
  return true;
}();

// ---- device functions of torch.openreg ----------------------------------------------------------
// Memory statistics go through the registered DeviceAllocator, so they are exactly torch's.
std::vector<int64_t> memory_stats(int64_t device) {
  const auto stats = c10::getDeviceAllocator(kDeviceType)->getDeviceStats(checked_index(device));
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {stats.allocated_bytes[all].current, stats.allocated_bytes[all].peak,
          stats.reserved_bytes[all].current,  stats.reserved_bytes[all].peak,
          stats.allocation[all].allocated,     stats.allocation[all].freed,
          stats.segment[all].current};
}

TORCH_LIBRARY(devipc_openreg, m) {
  m.def("device_count() -> int", [] { return static_cast<int64_t>(device_count()); });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(current_device()); });
  m.def("set_device(int device) -> ()",
        [](int64_t device) { GuardImpl().setDevice(Device(kDeviceType, device)); });
  m.def("synchronize(int device) -> ()",
        [](int64_t device) { GuardImpl().synchronizeDevice(device); });
  m.def("current_stream_id(int device) -> int", [](int64_t device) {
    return static_cast<int64_t>(current_stream_ids[checked_index(device)]);
  });
  // Seeds travel as int64; torch.openreg converts them from and to torch's uint64 seeds.
  m.def("manual_seed(int device, int seed) -> ()", [](int64_t device, int64_t seed) {
    at::Generator& generator = default_generator(device);
    const std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(static_cast<uint64_t>(seed));
  });
  m.def("initial_seed(int device) -> int", [](int64_t device) {
    return static_cast<int64_t>(default_generator(device).current_seed());
  });
  m.def("memory_stats(int device) -> int[]", &memory_stats);
  m.def("reset_peak_memory_stats(int device) -> ()", [](int64_t device) {
    c10::getDeviceAllocator(kDeviceType)->resetPeakStats(checked_index(device));
  });
  m.def("reset_accumulated_memory_stats(int device) -> ()", [](int64_t device) {
    c10::getDeviceAllocator(kDeviceType)->resetAccumulatedStats(checked_index(device));
  });
  m.def("empty_cache() -> ()", [] { c10::getDeviceAllocator(kDeviceType)->emptyCache(); });
}

}  // namespace

orStream_t current_stream(DeviceIndex device) {
  return native_stream(GuardImpl().getStream(Device(kDeviceType, device)));
}

}  // namespace devipc::openreg
