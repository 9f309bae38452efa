// The device guard: how torch sets devices, streams and events of openreg, and the device
// helpers the other concerns share (common.h).
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
  int count = 0;
  OR_CHECK(orGetDeviceCount(&count));  // names a refused OPENREG_* value
  TORCH_CHECK(index < count, "openreg: invalid device index ", static_cast<int>(index), "; ", count,
              " devices are visible (see OPENREG_DEVICE_COUNT, OPENREG_VISIBLE_DEVICES)");
  return static_cast<DeviceIndex>(index);
}

namespace {

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
  const c10::DeviceGuard guard(
      Device(kDeviceType, device));  // orStreamCreate uses the current device
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

  // torch.accelerator.get_device_capability: openreg holds any bytes and borrows the CPU's
  // kernels, so every dtype but those the CPU has no kernels for either (quantized tensors, and
  // the sub-byte integers that only carry a name).
  c10::DeviceCapability getDeviceCapability(Device /*device*/) const override {
    using c10::ScalarType;
    c10::DeviceCapability capability;  // starts with every dtype
    for (ScalarType dtype :
         {ScalarType::QInt8, ScalarType::QUInt8, ScalarType::QInt32, ScalarType::QUInt4x2,
          ScalarType::QUInt2x4, ScalarType::UInt1, ScalarType::UInt2, ScalarType::UInt3,
          ScalarType::UInt4, ScalarType::UInt5, ScalarType::UInt6, ScalarType::UInt7,
          ScalarType::Int1, ScalarType::Int2, ScalarType::Int3, ScalarType::Int4, ScalarType::Int5,
          ScalarType::Int6, ScalarType::Int7}) {
      capability.capability_data.capability_bits &= ~(uint64_t{1} << static_cast<int>(dtype));
    }
    return capability;
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
    TORCH_CHECK(
        device_index == -1 || device_index == stream.device_index(),
        "openreg: an event of openreg:", static_cast<int>(device_index),
        " cannot be recorded on a stream of openreg:", static_cast<int>(stream.device_index()));
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

// torch.openreg.set_stream and stream(): sets this thread's current stream of `device` without
// going through torch.accelerator, which only reaches the current accelerator.
TORCH_LIBRARY_FRAGMENT(devipc_openreg, m) {
  m.def("exchange_stream(int device, int stream_id) -> int", [](int64_t device, int64_t id) {
    const Stream stream(Stream::UNSAFE, Device(kDeviceType, checked_index(device)), id);
    native_stream(stream);  // an unknown stream id fails here, naming it
    return static_cast<int64_t>(GuardImpl().exchangeStream(stream).id());
  });
}

}  // namespace

orStream_t current_stream(DeviceIndex device) {
  return native_stream(GuardImpl().getStream(Device(kDeviceType, device)));
}

}  // namespace devipc::openreg
