// The bytes of an IPC handle, shared by memory and event handles, and opening the memfd it names.
#pragma once
#include <stdint.h>

#include "internal.h"

namespace openreg {

enum HandleKind : uint16_t { kMemHandle = 1, kEventHandle = 2 };

// Fixed layout, native byte order (handles never leave the host), specified in docs/ipc-handles.md.
// Unused bytes stay zero, and a handle with anything else there is rejected.
struct HandleData {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;
  int32_t pid;                      // exporting process
  int32_t fd;                       // its memfd, reached as /proc/<pid>/fd/<fd>
  uint64_t size;                    // bytes of the memfd
  int32_t physical;                 // memory: physical device index of the segment
  int32_t slot;                     // event: the event's slot in the exporter's event page
  uint32_t epoch;                   // event: the slot's epoch while the event lives (odd)
  unsigned char token[kTokenSize];  // random; part of the memfd's name
  unsigned char zero[OR_IPC_HANDLE_SIZE - 52];
};
static_assert(sizeof(HandleData) == OR_IPC_HANDLE_SIZE, "handle layout");

HandleData newHandle(HandleKind kind, pid_t pid, int fd, uint64_t size, const unsigned char* token);
// Checks the fixed fields of `bytes`; fails with orErrorInvalidHandle and a message naming `call`.
orError_t decodeHandle(const unsigned char* bytes, HandleKind kind, const char* call,
                       HandleData* out);
// Maps the memfd the handle names, following docs/ipc-handles.md: the exporter must be alive, not
// a zombie (else orErrorPeerGone), the file must open (a permission failure is
// orErrorInvalidHandle naming the rules) and be the memfd of exactly the handle's name and size
// (else orErrorInvalidHandle). No fd stays open: the mapping keeps the memory.
orError_t mapPeerFile(const HandleData& h, const char* call, void** base);
// mapPeerFile's checks without the mapping: *fd is the verified memfd, for the caller to close.
orError_t openPeerFile(const HandleData& h, const char* call, int* fd);

}  // namespace openreg
