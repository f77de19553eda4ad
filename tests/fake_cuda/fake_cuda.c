/*
 * A fake CUDA driver over host memory, for the fast park library's tests on machines without a GPU.
 *
 * It exports the driver calls pages.c opens, with the virtual memory calls' real semantics: an address
 * range is reserved (PROT_NONE), physical memory is a memfd, mapping it at an address makes the bytes
 * readable there, and the memory is freed only when it is neither mapped nor held by its handle. So the
 * tests run pages.c's real code paths and read and write "device" memory at the addresses it returns.
 *
 * The checks a real driver would make are made here too, loudly: copies only to and from mapped memory
 * whose access was set, and only through registered (pinned) host memory; every context push popped.
 * Tests steer it through fake_* calls: how much device memory there is, which call fails when.
 */

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define OK 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define INVALID_CONTEXT 201
#define ILLEGAL_ADDRESS 700
#define GRANULARITY ((size_t)2 << 20)
#define MAX_ITEMS 4096

typedef struct { int fd; size_t size; int refs; } physical;
typedef struct { CUdeviceptr va; size_t size; } range;
typedef struct { CUdeviceptr va; size_t size; physical *phys; int accessible; } mapped;

static range reservations[MAX_ITEMS];
static int reservation_count;
static mapped maps[MAX_ITEMS];
static int map_count;
static range registered[64];
static int registered_count;
static size_t capacity = (size_t)1 << 40; /* set from a test's thread while a resume waits: atomic */
static long out_of_memory_answers;           /* read from a test's thread: atomic */
static size_t used;
static int context_depth;
static int no_context;
static int context_token;
static long stream_counter;

/* ---- counting calls and failing them on request ---- */

typedef struct { char name[64]; long count; } counter;
static counter counters[64];

static void count(const char *name) {
    for (int i = 0; i < 64; i++) {
        if (!counters[i].name[0]) strncpy(counters[i].name, name, sizeof counters[i].name - 1);
        if (!strcmp(counters[i].name, name)) {
            counters[i].count++;
            return;
        }
    }
}

long fake_calls(const char *name) {
    for (int i = 0; i < 64 && counters[i].name[0]; i++)
        if (!strcmp(counters[i].name, name)) return counters[i].count;
    return 0;
}

typedef struct { char name[64]; long pass; int code; long times; } rule;
static rule rules[16];

/* `name` succeeds `pass` more times, then fails with `code` `times` times. */
void fake_fail(const char *name, long pass, int code, long times) {
    for (int i = 0; i < 16; i++) {
        if (rules[i].times == 0) {
            memset(&rules[i], 0, sizeof rules[i]);
            strncpy(rules[i].name, name, sizeof rules[i].name - 1);
            rules[i].pass = pass;
            rules[i].code = code;
            rules[i].times = times;
            return;
        }
    }
}

void fake_clear_failures(void) { memset(rules, 0, sizeof rules); }

static CUresult called(const char *name) {
    count(name);
    for (int i = 0; i < 16; i++) {
        if (rules[i].times == 0 || strcmp(rules[i].name, name)) continue;
        if (rules[i].pass > 0) {
            rules[i].pass--;
            continue;
        }
        rules[i].times--;
        return rules[i].code;
    }
    return OK;
}

void fake_set_capacity(size_t bytes) { __atomic_store_n(&capacity, bytes, __ATOMIC_SEQ_CST); }
long fake_out_of_memory_answers(void) { return __atomic_load_n(&out_of_memory_answers, __ATOMIC_SEQ_CST); }
size_t fake_device_used(void) { return used; }
int fake_context_depth(void) { return context_depth; }
void fake_set_no_context(int value) { no_context = value; }
int fake_registered_ranges(void) { return registered_count; }

/* ---- the driver calls ---- */

CUresult cuInit(unsigned flags) { (void)flags; return called("cuInit"); }

CUresult cuGetErrorName(CUresult code, const char **name) {
    switch (code) {
    case OK: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    default: return INVALID_VALUE;
    }
    return OK;
}

CUresult cuCtxGetCurrent(void **ctx) {
    *ctx = no_context ? NULL : &context_token;
    return OK;
}

CUresult cuCtxGetDevice(int *dev) {
    *dev = 0;
    return no_context ? INVALID_CONTEXT : OK;
}

CUresult cuCtxPushCurrent_v2(void *ctx) {
    if (ctx != &context_token) return INVALID_CONTEXT;
    CUresult code = called("cuCtxPushCurrent");
    if (code == OK) context_depth++;
    return code;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (context_depth == 0) return INVALID_CONTEXT;
    context_depth--;
    if (ctx) *ctx = &context_token;
    return OK;
}

CUresult cuCtxSynchronize(void) { return called("cuCtxSynchronize"); }

CUresult cuMemGetAllocationGranularity(size_t *granularity, const void *prop, int option) {
    (void)prop, (void)option;
    *granularity = GRANULARITY;
    return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    (void)addr, (void)flags;
    CUresult code = called("cuMemAddressReserve");
    if (code != OK) return code;
    if (size == 0 || size % GRANULARITY || reservation_count == MAX_ITEMS) return INVALID_VALUE;
    size_t align = alignment ? alignment : GRANULARITY;
    char *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return OUT_OF_MEMORY;
    uintptr_t start = ((uintptr_t)raw + align - 1) / align * align;
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    size_t tail = (uintptr_t)raw + size + align - (start + size);
    if (tail) munmap((void *)(start + size), tail);
    reservations[reservation_count++] = (range){start, size};
    *ptr = start;
    return OK;
}

static int overlaps_a_mapping(CUdeviceptr va, size_t size) {
    for (int i = 0; i < map_count; i++)
        if (va < maps[i].va + maps[i].size && maps[i].va < va + size) return 1;
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
    CUresult code = called("cuMemAddressFree");
    if (code != OK) return code;
    for (int i = 0; i < reservation_count; i++) {
        if (reservations[i].va != va || reservations[i].size != size) continue;
        if (overlaps_a_mapping(va, size)) return INVALID_VALUE; /* unmap first */
        munmap((void *)(uintptr_t)va, size);
        reservations[i] = reservations[--reservation_count];
        return OK;
    }
    return INVALID_VALUE;
}

static void drop_reference(physical *p) {
    if (--p->refs > 0) return;
    close(p->fd);
    used -= p->size;
    free(p);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop, unsigned long long flags) {
    (void)prop, (void)flags;
    CUresult code = called("cuMemCreate");
    if (code != OK) return code;
    if (size == 0 || size % GRANULARITY) return INVALID_VALUE;
    if (used + size > __atomic_load_n(&capacity, __ATOMIC_SEQ_CST)) {
        __atomic_add_fetch(&out_of_memory_answers, 1, __ATOMIC_SEQ_CST);
        return OUT_OF_MEMORY;
    }
    physical *p = calloc(1, sizeof *p);
    if (!p) return OUT_OF_MEMORY;
    p->fd = memfd_create("fake-device-memory", 0);
    if (p->fd < 0 || ftruncate(p->fd, (off_t)size) != 0) {
        if (p->fd >= 0) close(p->fd);
        free(p);
        return OUT_OF_MEMORY;
    }
    p->size = size;
    p->refs = 1;
    used += size;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult code = called("cuMemRelease");
    if (code != OK) return code;
    if (!handle) return INVALID_VALUE;
    drop_reference((physical *)(uintptr_t)handle);
    return OK;
}

static int inside_a_reservation(CUdeviceptr va, size_t size) {
    for (int i = 0; i < reservation_count; i++)
        if (va >= reservations[i].va && va + size <= reservations[i].va + reservations[i].size) return 1;
    return 0;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags) {
    (void)flags;
    CUresult code = called("cuMemMap");
    if (code != OK) return code;
    physical *p = (physical *)(uintptr_t)handle;
    if (!p || offset + size > p->size || !inside_a_reservation(va, size) || overlaps_a_mapping(va, size) ||
        map_count == MAX_ITEMS)
        return INVALID_VALUE;
    void *at = mmap((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset);
    if (at == MAP_FAILED) return OUT_OF_MEMORY;
    p->refs++;
    maps[map_count++] = (mapped){va, size, p, 0};
    return OK;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    CUresult code = called("cuMemUnmap");
    if (code != OK) return code;
    for (int i = 0; i < map_count; i++) {
        if (maps[i].va != va || maps[i].size != size) continue;
        /* The range goes back to reserved: no access, no memory. */
        mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        physical *p = maps[i].phys;
        maps[i] = maps[--map_count];
        drop_reference(p);
        return OK;
    }
    return INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count_) {
    CUresult code = called("cuMemSetAccess");
    if (code != OK) return code;
    if (count_ != 1 || desc->location.type != 1 || desc->flags != 3) return INVALID_VALUE;
    for (int i = 0; i < map_count; i++) {
        if (maps[i].va == va && maps[i].size == size) {
            maps[i].accessible = 1;
            return OK;
        }
    }
    return INVALID_VALUE;
}

static int device_range_ok(CUdeviceptr va, size_t n) {
    for (int i = 0; i < map_count; i++)
        if (va >= maps[i].va && va + n <= maps[i].va + maps[i].size) return maps[i].accessible;
    return 0;
}

static int host_range_pinned(const void *host, size_t n) {
    uintptr_t at = (uintptr_t)host;
    for (int i = 0; i < registered_count; i++)
        if (at >= registered[i].va && at + n <= registered[i].va + registered[i].size) return 1;
    return 0;
}

static CUresult copy_checks(const char *name, CUdeviceptr va, const void *host, size_t n, void *stream) {
    CUresult code = called(name);
    if (code != OK) return code;
    if (context_depth == 0) return INVALID_CONTEXT;
    if (!stream) return INVALID_VALUE; /* pages.c copies on streams of its own */
    if (!device_range_ok(va, n)) return ILLEGAL_ADDRESS;
    if (!host_range_pinned(host, n)) return INVALID_VALUE;
    return OK;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    CUresult code = copy_checks("cuMemcpyDtoHAsync", src, dst, n, stream);
    if (code == OK) memcpy(dst, (void *)(uintptr_t)src, n);
    return code;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    CUresult code = copy_checks("cuMemcpyHtoDAsync", dst, src, n, stream);
    if (code == OK) memcpy((void *)(uintptr_t)dst, src, n);
    return code;
}

CUresult cuStreamCreate(void **stream, unsigned flags) {
    (void)flags;
    CUresult code = called("cuStreamCreate");
    if (code == OK) *stream = (void *)(uintptr_t)++stream_counter;
    return code;
}

CUresult cuStreamSynchronize(void *stream) {
    (void)stream;
    return called("cuStreamSynchronize");
}

CUresult cuMemHostRegister_v2(void *host, size_t size, unsigned flags) {
    (void)flags;
    CUresult code = called("cuMemHostRegister");
    if (code != OK) return code;
    if (context_depth == 0 && no_context) return INVALID_CONTEXT;
    if (registered_count == 64) return OUT_OF_MEMORY;
    registered[registered_count++] = (range){(uintptr_t)host, size};
    return OK;
}

CUresult cuMemHostUnregister(void *host) {
    CUresult code = called("cuMemHostUnregister");
    if (code != OK) return code;
    if (context_depth == 0 && no_context) return INVALID_CONTEXT;
    for (int i = 0; i < registered_count; i++) {
        if (registered[i].va == (uintptr_t)host) {
            registered[i] = registered[--registered_count];
            return OK;
        }
    }
    return INVALID_VALUE;
}
