// Resize locks of host storages with queued copies. A non-blocking copy reads or writes host
// memory after it returns: the memory must outlive the copy, and resize_ (or a storage's resize_)
// must not free it meanwhile, so the storage is made non-resizable until the copy ran.
#include <c10/core/Storage.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels.h"

namespace devipc::openreg {
namespace {

using HostStorages = std::vector<c10::Storage>;

// Locked storages. Value: copies pending on the storage and the resizability to restore.
struct ResizeLocks {
  std::mutex mutex;
  std::unordered_map<c10::StorageImpl*, std::pair<int, bool>> locked;
};

ResizeLocks& resize_locks() {
  static auto* locks = new ResizeLocks();  // never destroyed: host functions may run at exit
  return *locks;
}

void lock_resizing(const HostStorages& storages) {
  ResizeLocks& locks = resize_locks();
  const std::lock_guard<std::mutex> lock(locks.mutex);
  for (const c10::Storage& s : storages) {
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    auto it = locks.locked.try_emplace(impl, 0, impl->resizable()).first;
    if (it->second.first++ == 0) impl->set_resizable(false);
  }
}

void unlock_resizing(const HostStorages& storages) noexcept {
  ResizeLocks& locks = resize_locks();
  const std::lock_guard<std::mutex> lock(locks.mutex);
  for (const c10::Storage& s : storages) {
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    auto it = locks.locked.find(impl);
    if (it == locks.locked.end() || --it->second.first > 0) continue;
    if (it->second.second && impl->allocator() != nullptr) impl->set_resizable(true);
    locks.locked.erase(it);
  }
}

}  // namespace

// The stream drops these references once the work queued before has run. Until then the storages
// cannot be resized (that would free the memory the copy uses): resize_ raises instead.
void hold_until_done(orStream_t stream, HostStorages storages) {
  auto held = std::make_unique<HostStorages>(std::move(storages));
  lock_resizing(*held);
  const orError_t err = orLaunchHostFunc(
      stream,
      [](void* p) {
        // Runs on the stream's worker thread, behind a C callback: nothing may escape.
        auto* storages = static_cast<HostStorages*>(p);
        unlock_resizing(*storages);
        try {
          delete storages;
        } catch (...) {
        }
      },
      held.get());
  if (err != orSuccess) unlock_resizing(*held);
  OR_CHECK(err);
  held.release();  // owned by the host function now
}

}  // namespace devipc::openreg
