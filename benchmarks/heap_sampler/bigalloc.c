// Preloaded in front of tcmalloc (benchmarks/heap_sampler/bigalloc.py): logs every allocation of at least
// BIGALLOC_MIN bytes (32 MiB) and its free, with tcmalloc's heap size before and after, to BIGALLOC_DIR/big-PID.log.
// No threads and no allocation of its own, so it does not move where blocks land.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <fcntl.h>
#include <time.h>

static int (*real_memalign)(void **, size_t, size_t);
static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static size_t (*usable)(void *);
static int (*getprop)(const char *, size_t *);
static int fd = -1;
static size_t minsz = 32u << 20;
#define MAXP 4096
static void *ptrs[MAXP]; static size_t sizes[MAXP];

static void init(void) {
  if (real_free) return;
  real_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_free = dlsym(RTLD_NEXT, "free");
  usable = dlsym(RTLD_NEXT, "malloc_usable_size");
  getprop = dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty");
  const char *d = getenv("BIGALLOC_DIR");
  if (d) {
    char p[512];
    snprintf(p, sizeof p, "%s/big-%d.log", d, getpid());
    fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  const char *m = getenv("BIGALLOC_MIN"); if (m) minsz = strtoull(m, 0, 10);
}
static size_t heap(void) { size_t v = 0; if (getprop) getprop("generic.heap_size", &v); return v; }
static size_t freeb(void) { size_t v = 0; if (getprop) getprop("tcmalloc.pageheap_free_bytes", &v); return v; }
static void logline(char op, size_t sz, void *p, size_t h0, size_t h1) {
  if (fd < 0) return;
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  char b[200];
  int n = snprintf(b, sizeof b, "%c %ld.%03ld %zu %p heap %zu -> %zu free %zu\n", op, (long)ts.tv_sec,
                   ts.tv_nsec / 1000000, sz, p, h0, h1, freeb());
  write(fd, b, n);
}
static void track(void *p, size_t sz) {
  for (int i = 0; i < MAXP; i++)
    if (!ptrs[i]) { ptrs[i] = p; sizes[i] = sz; return; }
}
int posix_memalign(void **out, size_t al, size_t sz) {
  init();
  if (sz < minsz) return real_memalign(out, al, sz);
  size_t h0 = heap(); int r = real_memalign(out, al, sz); size_t h1 = heap();
  if (!r) { track(*out, sz); logline('A', sz, *out, h0, h1); }
  return r;
}
void *malloc(size_t sz) {
  if (!real_malloc) { init(); }
  if (sz < minsz) return real_malloc(sz);
  size_t h0 = heap(); void *p = real_malloc(sz); size_t h1 = heap();
  if (p) { track(p, sz); logline('M', sz, p, h0, h1); }
  return p;
}
void free(void *p) {
  if (!real_free) init();
  if (p && (!usable || usable(p) >= minsz))  // only a large block can be in the table: no scan on small frees
    for (int i = 0; i < MAXP; i++)
      if (ptrs[i] == p) {
        ptrs[i] = 0;
        size_t h = heap();
        real_free(p);
        logline('F', sizes[i], p, h, heap());
        return;
      }
  real_free(p);
}
