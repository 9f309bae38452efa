// The runtime's C API driven from C++, with no Python and no torch between: what `make sanitize`
// runs under AddressSanitizer, UndefinedBehaviorSanitizer and ThreadSanitizer, and what
// tests/openreg/test_native.py builds with -Werror and runs. Threads share streams, events and
// the allocator at once (the stream workers, robust locks and event pages are what the
// sanitizers look at); memory and an interprocess event cross into a second process, a fresh
// exec of this program, as a consumer would take them.
//
//   runtime_test            all checks; prints "ok" and exits 0
//   runtime_test consume H  (internal) the consumer half, H the handles in hex
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "openreg.h"

extern char** environ;

namespace {

int failures = 0;

#define CHECK(condition)                                                               \
  do {                                                                                 \
    if (!(condition)) {                                                                \
      std::fprintf(stderr, "%s:%d: failed: %s (%s)\n", __FILE__, __LINE__, #condition, \
                   orGetLastErrorMessage());                                           \
      ++failures;                                                                      \
    }                                                                                  \
  } while (0)

#define OK(call) CHECK((call) == orSuccess)

constexpr unsigned char kProducerByte = 0x5a;
constexpr unsigned char kConsumerByte = 0xa5;
constexpr size_t kShared = size_t{1} << 20;

void count_up(void* counter) {
  static_cast<std::atomic<int>*>(counter)->fetch_add(1);
}

void check_allocator_from_threads() {
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      OK(orSetDevice(0));
      std::vector<void*> blocks;
      for (int i = 0; i < 200; ++i) {
        void* ptr = nullptr;
        OK(orMalloc(&ptr, static_cast<size_t>(1 + (i * 4099 + t * 97) % (3 * kShared))));
        CHECK(ptr != nullptr);
        blocks.push_back(ptr);
        if (i % 3 == 0) {
          OK(orFree(blocks.front()));
          blocks.erase(blocks.begin());
        }
      }
      for (void* ptr : blocks) OK(orFree(ptr));
    });
  }
  for (auto& thread : threads) thread.join();
  OK(orEmptyCache(0));
  orMemStats stats{};
  OK(orMemGetStats(0, &stats));
  CHECK(stats.allocated == 0);
  CHECK(stats.num_allocs == stats.num_frees);
  void* ptr = reinterpret_cast<void*>(0x1234);
  CHECK(orFree(ptr) == orErrorInvalidValue);
  OK(orMalloc(&ptr, 0));
  CHECK(ptr == nullptr);
}

void check_streams_and_events_from_threads() {
  orStream_t stream = nullptr;
  OK(orStreamCreate(&stream));
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      std::vector<unsigned char> host(4096, kProducerByte), back(4096, 0);
      void* device = nullptr;
      OK(orMalloc(&device, host.size()));
      orEvent_t event = nullptr;
      OK(orEventCreate(&event));
      for (int i = 0; i < 50; ++i) {
        OK(orMemcpyAsync(device, host.data(), host.size(), orMemcpyHostToDevice, stream));
        OK(orLaunchHostFunc(stream, count_up, &ran));
        OK(orEventRecord(event, stream));
        orError_t state = orEventQuery(event);
        CHECK(state == orSuccess || state == orErrorNotReady);
      }
      OK(orEventSynchronize(event));
      OK(orMemcpy(back.data(), device, back.size(), orMemcpyDeviceToHost));
      CHECK(back == host);
      OK(orEventDestroy(event));
      OK(orFree(device));
    });
  }
  for (auto& thread : threads) thread.join();
  OK(orStreamSynchronize(stream));
  CHECK(ran.load() == 200);
  CHECK(orStreamQuery(stream) == orSuccess);

  orEvent_t start = nullptr, end = nullptr;  // timing, and a destroy while a record is pending
  OK(orEventCreate(&start));
  OK(orEventCreate(&end));
  OK(orEventRecord(start, stream));
  OK(orLaunchHostFunc(stream, count_up, &ran));
  OK(orEventRecord(end, stream));
  OK(orEventDestroy(start));
  OK(orEventSynchronize(end));
  OK(orEventDestroy(end));
  OK(orStreamDestroy(stream));  // waits for its work
}

void check_batched_copies() {
  constexpr size_t kPairs = 300;
  std::vector<void*> dsts(kPairs), srcs(kPairs);
  std::vector<size_t> sizes(kPairs);
  std::vector<std::vector<unsigned char>> host(kPairs);
  for (size_t i = 0; i < kPairs; ++i) {
    sizes[i] = 1 + i * 13;
    host[i].assign(sizes[i], static_cast<unsigned char>(i));
    OK(orMalloc(&dsts[i], sizes[i]));
    srcs[i] = host[i].data();
  }
  orStream_t stream = nullptr;
  OK(orStreamCreate(&stream));
  OK(orMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), kPairs, stream));
  OK(orStreamSynchronize(stream));
  for (size_t i = 0; i < kPairs; ++i) {
    std::vector<unsigned char> back(sizes[i]);
    OK(orMemcpy(back.data(), dsts[i], sizes[i], orMemcpyDeviceToHost));
    CHECK(back == host[i]);
    OK(orFree(dsts[i]));
  }
  OK(orStreamDestroy(stream));
}

std::string hex(const unsigned char* bytes, size_t n) {
  std::string out;
  char digits[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(digits, sizeof digits, "%02x", bytes[i]);
    out += digits;
  }
  return out;
}

bool unhex(const std::string& text, unsigned char* bytes, size_t n) {
  if (text.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i)
    bytes[i] = static_cast<unsigned char>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  return true;
}

int consume(const std::string& handles) {
  orIpcMemHandle_t memory{};
  orIpcEventHandle_t event_handle{};
  CHECK(handles.size() == size_t{4} * OR_IPC_HANDLE_SIZE);
  CHECK(unhex(handles.substr(0, size_t{2} * OR_IPC_HANDLE_SIZE), memory.reserved,
              OR_IPC_HANDLE_SIZE));
  CHECK(unhex(handles.substr(size_t{2} * OR_IPC_HANDLE_SIZE), event_handle.reserved,
              OR_IPC_HANDLE_SIZE));
  orEvent_t event = nullptr;
  OK(orIpcOpenEventHandle(&event, event_handle));
  OK(orStreamWaitEvent(nullptr, event, 0));  // the producer's copy is done before ours reads
  void* base = nullptr;
  size_t size = 0;
  int device = -1;
  OK(orIpcOpenMemHandle(&base, &size, &device, memory));
  CHECK(size >= kShared);
  std::vector<unsigned char> seen(kShared), mine(kShared, kConsumerByte);
  OK(orMemcpy(seen.data(), base, kShared, orMemcpyDeviceToHost));
  CHECK(seen == std::vector<unsigned char>(kShared, kProducerByte));
  OK(orMemcpy(base, mine.data(), kShared, orMemcpyHostToDevice));
  OK(orIpcCloseMemHandle(base));
  OK(orEventDestroy(event));
  orIpcMemHandle_t forged = memory;
  forged.reserved[0] ^= 0xff;
  CHECK(orIpcOpenMemHandle(&base, &size, &device, forged) == orErrorInvalidHandle);
  return failures == 0 ? 0 : 1;
}

void check_memory_and_events_cross_processes(const char* self) {
  void* shared = nullptr;
  OK(orMalloc(&shared, kShared));
  orStream_t stream = nullptr;
  OK(orStreamCreate(&stream));
  std::vector<unsigned char> pattern(kShared, kProducerByte);
  OK(orMemcpyAsync(shared, pattern.data(), kShared, orMemcpyHostToDevice, stream));
  orEvent_t event = nullptr;
  OK(orEventCreateWithFlags(&event, orEventInterprocess | orEventDisableTiming));
  OK(orEventRecord(event, stream));
  orIpcMemHandle_t memory{};
  orIpcEventHandle_t event_handle{};
  size_t offset = 1;
  OK(orIpcGetMemHandle(&memory, &offset, shared));
  CHECK(offset == 0);
  OK(orIpcGetEventHandle(&event_handle, event));

  std::string handles =
      hex(memory.reserved, OR_IPC_HANDLE_SIZE) + hex(event_handle.reserved, OR_IPC_HANDLE_SIZE);
  std::string consume_word = "consume";
  char* argv[] = {const_cast<char*>(self), consume_word.data(), handles.data(), nullptr};
  pid_t child = 0;
  CHECK(posix_spawn(&child, self, nullptr, nullptr, argv, environ) == 0);
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  OK(orStreamSynchronize(stream));  // our copy ran before the consumer's, but not before ours
  std::vector<unsigned char> back(kShared);
  OK(orMemcpy(back.data(), shared, kShared, orMemcpyDeviceToHost));
  CHECK(back == std::vector<unsigned char>(kShared, kConsumerByte));  // zero-copy: its bytes
  OK(orEventDestroy(event));
  OK(orStreamDestroy(stream));
  OK(orFree(shared));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "consume") == 0) return consume(argv[2]);
  int count = 0;
  OK(orGetDeviceCount(&count));
  CHECK(count >= 1);
  CHECK(orSetDevice(count) == orErrorInvalidDevice);
  check_allocator_from_threads();
  check_streams_and_events_from_threads();
  check_batched_copies();
  check_memory_and_events_cross_processes("/proc/self/exe");
  if (failures != 0) {
    std::fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  std::puts("ok");
  return 0;
}
