// What the glue's compile units share: error checking of runtime calls and the current stream.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

#include "openreg.h"

// Turns a runtime failure into a c10::Error that names the call, the runtime's error and its detail.
#define OR_CHECK(expr)                                                                  \
  do {                                                                                  \
    const orError_t or_check_err_ = (expr);                                             \
    TORCH_CHECK(or_check_err_ == orSuccess, "openreg: ", #expr, " failed: ",            \
                orGetErrorString(or_check_err_), " (", orGetLastErrorMessage(), ")"); \
  } while (0)

namespace devipc::openreg {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;

// The runtime stream behind this thread's current c10 stream of `device` (device.cpp).
orStream_t current_stream(c10::DeviceIndex device);

// Grows or shrinks a resizable openreg storage, keeping its first bytes (ops.cpp).
void resize_storage_bytes(const c10::Storage& storage, size_t nbytes);

}  // namespace devipc::openreg
