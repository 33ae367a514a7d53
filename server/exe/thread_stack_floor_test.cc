// thread_stack_floor.c, linked and exported as in the daemon executables: a thread whose
// creator asks for 100 KiB (civetweb's USE_STACK_SIZE) through the dynamic linker's lookup, as a
// shared library's call resolves, runs on a stack of at least 1 MiB; larger requests are kept.
#include <dlfcn.h>
#include <pthread.h>

#include <cstddef>

#include "gtest/gtest.h"

namespace {

using SetStackSize = int (*)(pthread_attr_t*, size_t);

void* ReportStackSize(void* out) {
  pthread_attr_t attr;
  size_t size = 0;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    pthread_attr_getstacksize(&attr, &size);
    pthread_attr_destroy(&attr);
  }
  *static_cast<size_t*>(out) = size;
  return nullptr;
}

// The stack size a thread created with `requested` bytes (set through `set`) really has.
size_t ThreadStackSize(SetStackSize set, size_t requested) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  EXPECT_EQ(set(&attr, requested), 0);
  size_t got = 0;
  pthread_t t;
  EXPECT_EQ(pthread_create(&t, &attr, &ReportStackSize, &got), 0);
  pthread_join(t, nullptr);
  pthread_attr_destroy(&attr);
  return got;
}

TEST(ThreadStackFloor, SmallExplicitStacksAreRaisedToOneMebibyte) {
  // What a shared library's PLT call binds to: the first definition in the global scope.
  auto global = reinterpret_cast<SetStackSize>(dlsym(RTLD_DEFAULT, "pthread_attr_setstacksize"));
  // libc's own definition (not RTLD_NEXT: under ASan the LD_PRELOAD shim would come next).
  void* libc_handle = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(libc_handle, nullptr);
  auto libc = reinterpret_cast<SetStackSize>(dlsym(libc_handle, "pthread_attr_setstacksize"));
  ASSERT_NE(global, nullptr);
  ASSERT_NE(libc, nullptr);
  EXPECT_NE(global, libc) << "the executable's definition is not exported";
  EXPECT_GE(ThreadStackSize(global, 100 << 10), size_t{1} << 20);
  // Without the floor (libc's own), the thread keeps the 100 KiB it asked for: the check above
  // can fail.
  EXPECT_LT(ThreadStackSize(libc, 100 << 10), size_t{1} << 20);
  // Sizes above the floor are passed through.
  EXPECT_GE(ThreadStackSize(global, 4 << 20), size_t{4} << 20);
  EXPECT_LT(ThreadStackSize(global, 4 << 20), size_t{5} << 20);
  dlclose(libc_handle);
}

}  // namespace
