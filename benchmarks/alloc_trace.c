/* An LD_PRELOAD allocation trace of every thread (benchmarks/alloc_trace.py builds and reads it).

   torch's CPU allocator takes its buffers from posix_memalign and gives them back with free, on
   whichever thread drops the last reference (gloo's worker threads included). This library
   wraps those calls (and memalign, aligned_alloc, and malloc/calloc/realloc of blocks of at
   least MALLOC_MIN bytes: below that, Python objects and arena chunks), keeps every live
   block's size from the start of the process, and while tracing appends one record per
   allocation (+bytes) and per free of a known block (-bytes), with the thread and whether the
   block came from an aligned allocation (torch's) or malloc, in the order they happen: a free
   is logged before the block goes back to libc, an allocation after libc hands it out, both
   under one lock, so the log's order is the order of the address's lives. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>
#include <sys/syscall.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

#define MALLOC_MIN (64 * 1024)
#define SLOT_BITS 20 /* room for 2^20 live blocks: open addressing, linear probing */
#define SLOTS (1u << SLOT_BITS)
#define RECORDS (1u << 24)

typedef struct { uintptr_t ptr; size_t size; uint32_t aligned; } slot_t;
typedef struct { int64_t bytes; uint64_t ptr; uint32_t tid, aligned; } record_t;

static slot_t *slots;
static record_t *records;
static uint64_t count, overflow, live;
static int tracing;
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER; /* a spinlock wastes oversubscribed cores */

static void lock(void) { pthread_mutex_lock(&mutex); }
static void unlock(void) { pthread_mutex_unlock(&mutex); }

static void *map(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) abort();
    return p;
}

static uint32_t home(uintptr_t ptr) { return (uint32_t)((ptr >> 4) * 0x9E3779B97F4A7C15ull >> (64 - SLOT_BITS)); }

static void append(int64_t bytes, uintptr_t ptr, uint32_t aligned) { /* under the lock */
    if (!tracing) return;
    if (count == RECORDS) { overflow = 1; return; }
    records[count++] = (record_t){bytes, ptr, (uint32_t)syscall(SYS_gettid), aligned};
}

static void added(void *p, size_t size, uint32_t aligned) {
    if (!p) return;
    lock();
    if (!slots) { slots = map(SLOTS * sizeof(slot_t)); records = map(RECORDS * sizeof(record_t)); }
    if (++live == SLOTS) abort();
    uint32_t i = home((uintptr_t)p);
    while (slots[i].ptr) i = (i + 1) & (SLOTS - 1);
    slots[i] = (slot_t){(uintptr_t)p, size, aligned};
    append((int64_t)size, (uintptr_t)p, aligned);
    unlock();
}

static void removed(void *p) { /* before the block goes back to libc */
    if (!p || !slots) return;
    lock();
    uint32_t i = home((uintptr_t)p);
    while (slots[i].ptr && slots[i].ptr != (uintptr_t)p) i = (i + 1) & (SLOTS - 1);
    if (slots[i].ptr) {
        append(-(int64_t)slots[i].size, (uintptr_t)p, slots[i].aligned);
        /* backward-shift deletion keeps every probe chain unbroken without tombstones */
        for (uint32_t j = (i + 1) & (SLOTS - 1); slots[j].ptr; j = (j + 1) & (SLOTS - 1)) {
            uint32_t h = home(slots[j].ptr);
            if (((j - h) & (SLOTS - 1)) >= ((j - i) & (SLOTS - 1))) { slots[i] = slots[j]; i = j; }
        }
        slots[i].ptr = 0;
        live--;
    }
    unlock();
}

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (alignment % sizeof(void *) || (alignment & (alignment - 1))) return EINVAL;
    void *p = __libc_memalign(alignment, size);
    if (!p) return ENOMEM;
    added(p, size, 1);
    *out = p;
    return 0;
}

void *memalign(size_t alignment, size_t size) {
    void *p = __libc_memalign(alignment, size);
    added(p, size, 1);
    return p;
}

void *aligned_alloc(size_t alignment, size_t size) { return memalign(alignment, size); }

void *malloc(size_t size) {
    void *p = __libc_malloc(size);
    if (size >= MALLOC_MIN) added(p, size, 0);
    return p;
}

void *calloc(size_t n, size_t size) {
    void *p = __libc_calloc(n, size);
    if (n && size && n * size / n == size && n * size >= MALLOC_MIN) added(p, n * size, 0);
    return p;
}

void *realloc(void *old, size_t size) {
    removed(old); /* a failed realloc keeps the block, untraced from here on */
    void *p = __libc_realloc(old, size);
    if (size >= MALLOC_MIN) added(p, size, 0);
    return p;
}

void free(void *p) { removed(p); __libc_free(p); }

/* The interface alloc_trace.py calls through ctypes. */
void alloc_trace_start(void) { lock(); count = overflow = 0; tracing = 1; unlock(); }
void alloc_trace_stop(void) { lock(); tracing = 0; unlock(); }
uint64_t alloc_trace_position(void) { lock(); uint64_t n = count; unlock(); return n; }
uint64_t alloc_trace_overflowed(void) { return overflow; }
const record_t *alloc_trace_records(void) { return records; }
