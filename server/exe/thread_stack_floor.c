/* Raises every explicit thread stack size below 1 MiB to 1 MiB, by interposing
 * pthread_attr_setstacksize. Linked into the daemon executables (server/CMakeLists.txt, which
 * exports the symbol so that shared libraries resolve to it), and built as an LD_PRELOAD shim
 * for the ASan runs of the test binaries (scripts/sanitize.sh).
 *
 * Why: Debian's civetweb (the HTTP server inside prometheus-cpp's Exposer, which serves the
 * daemon's /metrics) is built with USE_STACK_SIZE=102400: it creates its master and worker
 * threads with pthread_attr_setstacksize(100 KiB). glibc carves the process's static TLS out
 * of that stack, and the daemon's static TLS is about 63 KiB, 60 KiB of it OpenBLAS's
 * (libopenblas.so.0's PT_TLS is 0xf000 bytes), which leaves civetweb's threads about 35 KiB:
 * enough for today's scrapes of the uninstrumented daemon, a latent overflow for anything
 * deeper, and an overflow under ASan (the first scrape's mg_printf -> vsnprintf -> glibc's
 * printf_positional). No civetweb option, RLIMIT_STACK or ASAN_OPTIONS changes a size given
 * explicitly; interposing the call does.
 *
 * Plain C, never instrumented; it changes nothing but the sizes below the floor
 * (DIOND_THREAD_STACK_FLOOR_KB overrides the 1024 KiB). */
#define _GNU_SOURCE  // NOLINT(bugprone-reserved-identifier): glibc's feature macro, for RTLD_NEXT
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

typedef int (*setstacksize_fn)(pthread_attr_t*, size_t);

static setstacksize_fn real_setstacksize;
static size_t floor_bytes = (size_t)1024 << 10;

__attribute__((constructor)) static void init_floor(void) {
  const char* kb = getenv("DIOND_THREAD_STACK_FLOOR_KB");
  if (kb != NULL && *kb != '\0') {
    char* end = NULL;
    unsigned long v = strtoul(kb, &end, 10);
    if (end != NULL && *end == '\0' && v > 0 && v < (1ul << 22)) floor_bytes = (size_t)v << 10;
  }
  real_setstacksize = (setstacksize_fn)dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
}

int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  setstacksize_fn real = __atomic_load_n(&real_setstacksize, __ATOMIC_ACQUIRE);
  if (real == NULL) {
    real = (setstacksize_fn)dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
    __atomic_store_n(&real_setstacksize, real, __ATOMIC_RELEASE);
  }
  return real(attr, size < floor_bytes ? floor_bytes : size);
}
