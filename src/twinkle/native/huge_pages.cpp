// A CPU allocator for torch that backs large blocks with transparent huge pages, as torch's own
// does when THP_MEM_ALLOC_ENABLE=1 is set before it starts; this one can be installed at any time.
// Built and installed by twinkle/utils/huge_pages.py, which says why.
//
// A block of at least `min_block` bytes is aligned to 2 MiB and marked MADV_HUGEPAGE, so that the
// kernel maps it 2 MiB at a time instead of faulting in (and zeroing) one 4 KiB page per touch.
// Smaller requests go to the allocator it replaced. Every block is freed with free(), as torch's.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

std::mutex mutex;
std::unordered_map<void*, size_t> sizes;  // this allocator's live blocks, for the memory profiler
std::atomic<uint64_t> made{0}, marked{0};
size_t live = 0;

void release(void* p) {
  size_t size = 0, now = 0;
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto found = sizes.find(p);
    if (found != sizes.end()) {
      size = found->second;
      live -= size;
      sizes.erase(found);
    }
    now = live;
  }
  if (size != 0 && c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(p, -static_cast<int64_t>(size), now, now, c10::Device(c10::DeviceType::CPU));
  }
  std::free(p);  // c10::free_cpu is free() on Linux too, so this also frees the replaced allocator's raw blocks
}

class HugePages final : public c10::Allocator {
 public:
  HugePages(c10::Allocator* base, size_t min_block) : base_(base), min_block_(min_block) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_block_.load(std::memory_order_relaxed)) return base_->allocate(n);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, n) != 0 || p == nullptr) {
      return base_->allocate(n);  // let the replaced allocator fail with torch's own message
    }
    ++made;
    if (madvise(p, n, MADV_HUGEPAGE) == 0) ++marked;
    size_t now = 0;
    {
      std::lock_guard<std::mutex> guard(mutex);
      sizes[p] = n;
      now = live += n;
    }
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(n), now, now, c10::Device(c10::DeviceType::CPU));
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_min_block(size_t min_block) { min_block_.store(min_block, std::memory_order_relaxed); }
  c10::Allocator* base() const { return base_; }

 private:
  c10::Allocator* base_;
  std::atomic<size_t> min_block_;
};

HugePages* allocator = nullptr;  // never deleted: blocks it handed out may outlive an uninstall

}  // namespace

extern "C" {

// Make this torch's CPU allocator, for blocks of at least `min_block` bytes (also when installed).
int twinkle_huge_pages_install(uint64_t min_block) {
  if (allocator == nullptr) allocator = new HugePages(c10::GetCPUAllocator(), min_block);
  allocator->set_min_block(min_block);
  c10::SetCPUAllocator(allocator, 0);
  return 0;
}

// Put the replaced allocator back; blocks made here are still freed correctly when released.
int twinkle_huge_pages_uninstall() {
  if (allocator != nullptr) c10::SetCPUAllocator(allocator->base(), 0);
  return 0;
}

int twinkle_huge_pages_installed() { return allocator != nullptr && c10::GetCPUAllocator() == allocator; }

// blocks made here, of which marked for huge pages, and bytes in use now
void twinkle_huge_pages_stats(uint64_t* out) {
  std::lock_guard<std::mutex> guard(mutex);
  out[0] = made.load();
  out[1] = marked.load();
  out[2] = live;
}
}
