// openreg runtime: a CUDA-like C API for the reference accelerator. No torch headers here.
//
// Device memory is host-addressable shared memory (memfd + MAP_SHARED), carved out of larger
// segments by a caching allocator, so another process can map the very same pages (zero-copy IPC)
// and nothing named is ever left in /dev/shm. orXxx mirrors cudaXxx unless noted.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum orError_t {
  orSuccess = 0,
  orErrorInvalidValue = 1,      // bad argument (null out-pointer, unknown pointer to orFree, ...)
  orErrorMemoryAllocation = 2,  // the OS refused memory
  orErrorInvalidDevice = 3,     // index out of range, or a device not visible here
  orErrorInvalidResourceHandle = 4,  // bad stream or event
  orErrorNotReady = 5,               // query: work still pending (not a failure)
  orErrorInvalidHandle = 6,          // IPC handle forged, truncated or naming something else
  orErrorPeerGone = 7,               // the process that exported an IPC handle has exited
  orErrorOsCall = 8,                 // an OS call failed; see orGetLastErrorMessage
  orErrorInitialization = 9,         // used in a child forked after the parent used the runtime
  orErrorInvalidEnvironment = 10,  // OPENREG_DEVICE_COUNT or OPENREG_VISIBLE_DEVICES makes no sense
} orError_t;

const char* orGetErrorString(orError_t error);
// Detail of this thread's last failure ("" if none): it names the call and the cause.
const char* orGetLastErrorMessage(void);

// ---- Devices ------------------------------------------------------------------------------------
// OPENREG_DEVICE_COUNT (default 2) physical devices; OPENREG_VISIBLE_DEVICES="1,0" selects and
// renumbers them like CUDA_VISIBLE_DEVICES. Both are read once, at first use. A value that makes
// no sense (not a number, negative, out of range, a repeated entry) is refused: every call naming
// a device, and orGetDeviceCount (which still sets *count = 0), fail with
// orErrorInvalidEnvironment and a message echoing the value.
orError_t orGetDeviceCount(int* count);
orError_t orGetDevice(int* device);  // per thread, default 0
orError_t orSetDevice(int device);
// Stable identity, independent of renumbering: 36 chars + NUL, so len >= 37.
orError_t orDeviceGetUuid(int device, char* uuid, size_t len);
orError_t orDeviceGetByUuid(const char* uuid, int* device);  // orErrorInvalidDevice if not visible
orError_t orDeviceSynchronize(void);                         // all streams of the current device

// Like CUDA, a child forked after its parent used the runtime (a device, memory, a stream, an
// event) cannot use it: those calls fail with orErrorInitialization. Counting devices is no use.
typedef enum orRuntimeState {
  orRuntimeUnused = 0,          // nothing in this process has used the runtime yet
  orRuntimeInitialized = 1,     // this process uses it
  orRuntimeForkedAfterUse = 2,  // forked after its parent used it: refused
} orRuntimeState;
orError_t orGetRuntimeState(orRuntimeState* state);

// ---- Memory -------------------------------------------------------------------------------------
// Allocations are cached: orFree returns a block to its segment; orEmptyCache unmaps segments with
// no live block. A block is 512-byte aligned.
orError_t orMalloc(void** ptr, size_t size);  // on the current device; size 0 gives NULL
orError_t orFree(void* ptr);                  // NULL is a no-op
orError_t orEmptyCache(int device);
// The memory devices allocate from: the host's (shared by every device), in bytes. Unlike
// cudaMemGetInfo, names the device.
orError_t orMemGetInfo(int device, size_t* free, size_t* total);

// Pinned host memory, CUDA's cudaHostAlloc: host memory the runtime knows, so copies from and to
// it may run asynchronously. There is no DMA engine to pin pages for, so it is not page-locked.
orError_t orHostAlloc(void** ptr, size_t size);  // size 0 gives NULL
orError_t orFreeHost(void* ptr);                 // NULL is a no-op

typedef struct orMemStats {
  uint64_t allocated;  // bytes in live blocks
  uint64_t peak_allocated;
  uint64_t reserved;  // bytes in mapped segments
  uint64_t peak_reserved;
  uint64_t num_allocs;    // accumulated
  uint64_t num_frees;     // accumulated
  uint64_t num_segments;  // current
} orMemStats;
orError_t orMemGetStats(int device, orMemStats* stats);
orError_t orMemResetPeakStats(int device);         // peaks := current
orError_t orMemResetAccumulatedStats(int device);  // num_allocs, num_frees := 0

typedef enum orMemoryType {
  orMemoryTypeUnregistered = 0,  // not openreg memory
  orMemoryTypeHost = 1,          // from orHostAlloc (device is -1)
  orMemoryTypeDevice = 2,
} orMemoryType;
typedef struct orPointerAttributes {
  orMemoryType type;
  int device;     // local index
  void* base;     // base of the segment (or IPC mapping) holding the pointer
  size_t size;    // bytes of that segment
  size_t offset;  // ptr - base
} orPointerAttributes;
// Resolves interior pointers of live segments, of IPC-opened mappings and of orHostAlloc blocks
// (base and size are then the block's); other pointers give type = orMemoryTypeUnregistered and
// orSuccess.
orError_t orPointerGetAttributes(orPointerAttributes* attributes, const void* ptr);

typedef enum orMemcpyKind {
  orMemcpyHostToHost = 0,
  orMemcpyHostToDevice = 1,
  orMemcpyDeviceToHost = 2,
  orMemcpyDeviceToDevice = 3,
} orMemcpyKind;

// ---- Streams ------------------------------------------------------------------------------------
// A stream is a worker thread running its work in FIFO order. NULL means the default stream of the
// current device. Every stream has a small id, unique per device: 0 is the default stream.
typedef struct orStream* orStream_t;
orError_t orStreamCreate(orStream_t* stream);  // on the current device
orError_t orStreamDestroy(orStream_t stream);  // waits for its work; the default stream is kept
orError_t orStreamSynchronize(orStream_t stream);
orError_t orStreamQuery(orStream_t stream);  // orSuccess if idle, orErrorNotReady otherwise
orError_t orStreamGetDevice(orStream_t stream, int* device);
orError_t orStreamGetId(orStream_t stream, int64_t* id);
orError_t orStreamFromId(int device, int64_t id, orStream_t* stream);  // id 0: default stream
typedef void (*orHostFn_t)(void* user_data);
orError_t orLaunchHostFunc(orStream_t stream, orHostFn_t fn, void* user_data);

// Synchronous copy: ordered after the work already on the current device's default stream,
// complete on return.
orError_t orMemcpy(void* dst, const void* src, size_t count, orMemcpyKind kind);
orError_t orMemcpyAsync(void* dst, const void* src, size_t count, orMemcpyKind kind,
                        orStream_t stream);

// ---- Events -------------------------------------------------------------------------------------
typedef struct orEvent* orEvent_t;
enum {
  orEventDefault = 0,
  orEventDisableTiming = 2,
  orEventInterprocess = 4,  // must come with orEventDisableTiming, as in CUDA
};
orError_t orEventCreate(orEvent_t* event);
orError_t orEventCreateWithFlags(orEvent_t* event, unsigned int flags);
orError_t orEventDestroy(orEvent_t event);  // safe while its record is pending
orError_t orEventRecord(orEvent_t event, orStream_t stream);
orError_t orEventQuery(orEvent_t event);  // orSuccess if done or never recorded
orError_t orEventSynchronize(orEvent_t event);
orError_t orEventElapsedTime(float* ms, orEvent_t start, orEvent_t end);  // both done, timed
orError_t orStreamWaitEvent(orStream_t stream, orEvent_t event, unsigned int flags);

// ---- IPC ----------------------------------------------------------------------------------------
// Handles are plain, opaque bytes: they name a memfd of the exporting process (opened by the
// importer through /proc/<pid>/fd, so the importer must run as the same user, in the same PID
// namespace, and the exporter must be dumpable) plus a random token that the importer checks.
// Opening fails with orErrorPeerGone once the exporter has exited (a zombie included), and with
// orErrorInvalidHandle for anything forged, truncated or stale, or when those rules deny access.
// docs/ipc-handles.md specifies the bytes and the checks.
#define OR_IPC_HANDLE_SIZE 64
typedef struct orIpcMemHandle_t {
  unsigned char reserved[OR_IPC_HANDLE_SIZE];
} orIpcMemHandle_t;
typedef struct orIpcEventHandle_t {
  unsigned char reserved[OR_IPC_HANDLE_SIZE];
} orIpcEventHandle_t;

// Unlike CUDA, ptr may point inside a segment: the handle names the whole segment and *offset
// gives ptr's byte offset in it.
orError_t orIpcGetMemHandle(orIpcMemHandle_t* handle, size_t* offset, const void* ptr);
// Maps the whole segment. *device is the local index of the segment's device (matched by UUID, so
// it survives different OPENREG_VISIBLE_DEVICES); orErrorInvalidDevice if that device is not
// visible. Opening the same segment again in one process returns the same base, one more open.
orError_t orIpcOpenMemHandle(void** base, size_t* size, int* device, orIpcMemHandle_t handle);
orError_t orIpcCloseMemHandle(void* base);  // unmaps at the last close

// As in CUDA, the handle names the EVENT (which needs orEventInterprocess), not one record: every
// process that opened it may record it, and a query, synchronize or stream wait, in any of them,
// is for its latest record at that moment, whoever made it. If the process that made that record
// exits before it completes, stream waits are released and orEventQuery/orEventSynchronize fail
// with orErrorPeerGone. Opening refuses (orErrorInvalidHandle) a slot or epoch the exporter never
// handed out; a handle of an event its creator has since destroyed opens with nothing to wait for
// and cannot be recorded. Destroy an opened event with orEventDestroy.
orError_t orIpcGetEventHandle(orIpcEventHandle_t* handle, orEvent_t event);
orError_t orIpcOpenEventHandle(orEvent_t* event, orIpcEventHandle_t handle);

// ---- Batched copies (added last: the API above keeps its order) ------------------------------
// CUDA's cudaMemcpyBatchAsync: count byte copies dsts[i] <- srcs[i] of sizes[i] bytes, enqueued on
// `stream` as ONE operation that runs them in order. The kind of each copy is inferred: at least
// one side of every copy of a non-zero size must be openreg device memory, and a side inside
// device memory must fit in its segment (orErrorInvalidValue naming the copy's index otherwise;
// nothing is enqueued then). The arrays are copied: they may be reused on return.
orError_t orMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes,
                             size_t count, orStream_t stream);

#ifdef __cplusplus
}
#endif
