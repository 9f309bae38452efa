// What the glue's concerns share: error checking of runtime calls, devices, the current stream,
// the default generators and the growth of storages.
#pragma once
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

#include "openreg.h"

// A runtime failure as a c10::Error that names the call, the runtime's error and its detail.
#define OR_CHECK(expr)                                                                             \
  do {                                                                                             \
    const orError_t or_check_err_ = (expr);                                                        \
    TORCH_CHECK(or_check_err_ == orSuccess, "openreg: ", #expr,                                    \
                " failed: ", orGetErrorString(or_check_err_), " (", orGetLastErrorMessage(), ")"); \
  } while (0)

namespace devipc::openreg {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;

// A tensor or storage on openreg.
template <typename T>
bool on_openreg(const T& t) {
  return t.device().type() == kDeviceType;
}

// ---- devices (guard.cpp) ------------------------------------------------------------------------
// Visible devices; 0 if the runtime cannot tell (it never throws: torch asks from noexcept code).
c10::DeviceIndex device_count() noexcept;

// This thread's current device.
c10::DeviceIndex current_device();

// `index` if it names a visible device, the current device if negative; raises otherwise.
c10::DeviceIndex checked_index(int64_t index);

// The runtime stream behind this thread's current c10 stream of `device`.
orStream_t current_stream(c10::DeviceIndex device);

// ---- generators (generator.cpp) -----------------------------------------------------------------
at::Generator new_generator(c10::DeviceIndex device);

// The default generator of a device (`device` as checked_index takes it).
at::Generator& default_generator(int64_t device);

// ---- storages (storage.cpp) ---------------------------------------------------------------------
// Grows or shrinks a resizable openreg storage, keeping its first bytes.
void resize_storage_bytes(const c10::Storage& storage, size_t nbytes);

}  // namespace devipc::openreg
