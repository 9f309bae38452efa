// Error strings and the thread-local message of the last failure.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define OPENREG_DEFINES_FAIL  // the one definition, which the analyzer reads as written
#include "internal.h"

namespace {
thread_local char lastMessage[1024] = "";
}

namespace openreg {
orError_t fail(orError_t err, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(lastMessage, sizeof(lastMessage), fmt, args);
  va_end(args);
  return err;
}

const char* osError(int e) {
  thread_local char text[256];
  return strerror_r(e, text, sizeof(text));  // the GNU variant: the text, in `text` or static
}
}  // namespace openreg

extern "C" {

const char* orGetErrorString(orError_t error) {
  switch (error) {
    case orSuccess:
      return "no error";
    case orErrorInvalidValue:
      return "invalid argument";
    case orErrorMemoryAllocation:
      return "out of memory";
    case orErrorInvalidDevice:
      return "invalid device ordinal";
    case orErrorInvalidResourceHandle:
      return "invalid resource handle";
    case orErrorNotReady:
      return "device not ready";
    case orErrorInvalidHandle:
      return "invalid IPC handle";
    case orErrorPeerGone:
      return "exporting process has exited";
    case orErrorOsCall:
      return "operating system call failed";
    case orErrorInitialization:
      return "initialization error";
    case orErrorInvalidEnvironment:
      return "invalid environment";
  }
  return "unknown error";
}

const char* orGetLastErrorMessage(void) {
  return lastMessage;
}

}  // extern "C"
