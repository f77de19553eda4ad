/*
 * The fast park path: a process's device allocations served from CUDA virtual memory, so that their
 * physical pages can leave the device and come back at the same addresses.
 *
 * Loaded with LD_PRELOAD into a torch kernel, this library defines cudaMalloc and cudaFree. The dynamic
 * linker binds torch's calls (its caching allocator asks cudaMalloc for whole segments) to these instead of
 * libcudart's. Each segment becomes one "mapping": an address range reserved once (cuMemAddressReserve),
 * physical memory created (cuMemCreate) and mapped there (cuMemMap + cuMemSetAccess). torch keeps caching
 * inside its segments and keeps its per-process memory fraction; it never learns where its segments live.
 *
 * A mapping's physical memory is made of pieces (GQX_PAGES_PIECE_BYTES, 2 GiB by default), each created and
 * mapped on its own at its place in the range: a park can give the device back piece by piece, and a resume
 * can take it back piece by piece, so a swap (one process parks while another resumes into the room it
 * leaves) runs both copies at once instead of one after the other. PCIe carries both directions at full speed.
 *
 * gqx_park(arena, 0) copies every mapping's bytes to one pinned host arena (made once by gqx_arena_create,
 * kept and reused: pinning costs more than copying), then unmaps and releases the physical memory; the
 * address ranges stay reserved. gqx_park(arena, 1) releases each piece as soon as its bytes are in the arena.
 * gqx_resume(ms) creates physical memory again piece by piece, maps it at the same addresses and copies the
 * bytes back; when the device is full it waits (at most `ms` in all, 0: not at all) for memory that a park
 * under way elsewhere is releasing. Copies go in large chunks on two streams.
 *
 * What a failure leaves: a park releases nothing until every byte is in the arena, except one that releases
 * as it copies: that one, failing midway, leaves the process parked in part (GQX_E_PARTIAL: the released
 * pieces' bytes in the arena, the rest still on the device; a resume brings all of it back). A resume keeps
 * the host copy (and the parked state) until every byte is back, and on failure gives back every piece it
 * took, whether its copy had begun or not: a resume that runs out of device memory or of its wait is
 * recoverable, unlike a checkpoint restore into a full device. On any failure the call returns a code and a
 * message (gqx_last_error).
 *
 * There are no CUDA headers where this is built: the few driver types and prototypes are declared here,
 * and the driver is opened with dlopen("libcuda.so.1") at the first allocation (GQX_PAGES_LIBCUDA names
 * another file, for the tests' fake driver). When the driver cannot be used, allocations pass through to
 * libcudart unchanged and nothing can be parked (gqx_active() says 0, gqx_last_error says why).
 *
 * Not served here, so never parked (they stay on the device, valid): cudaMallocAsync, cudaMallocManaged,
 * cudaMallocHost, driver-API allocations of other libraries, allocations of statically linked runtimes.
 * The CUDA context itself stays too.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* ---- the driver API, as far as this file needs it (cuda.h, CUDA 12 and 13) ---------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_STREAM_NON_BLOCKING 1
#define CU_MEMHOSTREGISTER_PORTABLE 1

/* cudaError_t values returned by the interposed runtime calls (driver_types.h). */
#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorMemoryAllocation 2

/* Codes of this library's own (negative, so they never collide with a CUresult). */
#define GQX_E_STATE (-1)   /* the call does not fit the state (park while parked, ...) */
#define GQX_E_ARENA (-2)   /* no arena, or one too small for what is mapped */
#define GQX_E_DRIVER (-3)  /* the driver could not be opened: nothing is served, nothing parks */
#define GQX_E_HOST (-4)    /* host memory for the arena could not be had */
#define GQX_E_CONTEXT (-5) /* no CUDA context known to this library yet */
#define GQX_E_PARTIAL (-6) /* a park that released as it copied failed midway: parked in part (see above) */

/* States (gqx_state). */
#define GQX_RUNNING 0
#define GQX_PARKING 1
#define GQX_PARKED 2
#define GQX_RESUMING 3

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*MemHostRegister)(void *, size_t, unsigned);
    CUresult (*MemHostUnregister)(void *);
} cu;

/* libcudart's own calls, for what is not served here (found after this library in the lookup order). */
static int (*real_cudaMalloc)(void **, size_t);
static int (*real_cudaFree)(void *);

/* ---- the table of allocations ------------------------------------------------------------------------- */

typedef struct {
    CUmemGenericAllocationHandle handle;
    int resident; /* mapped at its place (0 while parked or parked in part, or given back by a failed cudaFree) */
    int fresh;    /* backed by the resume under way: given back if that resume fails */
    int parked;   /* its bytes are in the arena, put there by the park: what the resume brings back (a piece that
                   * is not resident for another reason, one a failed cudaFree gave back, is not) */
} piece;

typedef struct {
    CUdeviceptr va;     /* where the caller sees it; never changes */
    size_t size;        /* what the caller asked for */
    size_t padded;      /* size rounded up to the granularity: what is reserved, created and mapped */
    CUcontext ctx;      /* the context current at allocation: copies for this mapping run in it */
    CUdevice dev;
    size_t piece_bytes; /* each piece's length (a multiple of the granularity); the last one takes the rest */
    size_t npieces;
    piece one;          /* the only piece of a mapping no larger than a piece (most of them: no allocation) */
    piece *many;        /* the pieces of a larger one (then `one` is unused) */
    int passthrough;    /* served by libcudart (the driver path failed): freed there, never parked */
    size_t host_offset; /* where its bytes sit in the arena while parked */
} mapping;

/* Two pairs of streams per context: the pieces of a park or resume alternate between the pairs, so that the
 * pair of the piece before can be waited for (and that piece released) while this piece's copy runs. */
typedef struct {
    CUcontext ctx;
    CUstream stream[4];
} context_streams;

#define MAX_CONTEXTS 64

struct gqx_arena {
    char *base;
    size_t size;
    int registered;
    double populate_seconds;
    double register_seconds;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_running = PTHREAD_COND_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_active;              /* the driver is open: allocations are served here */
static int g_state = GQX_RUNNING;
static mapping *g_maps;
static size_t g_count, g_capacity;
static context_streams g_ctx[MAX_CONTEXTS];
static size_t g_ctx_count;
static CUcontext g_last_ctx;      /* for calls made from threads without a current context */
static struct gqx_arena *g_parked_in; /* the arena that holds the parked bytes */
static size_t g_chunk = (size_t)64 << 20;
static size_t g_piece = (size_t)2 << 30;
static char g_error[512];
static double g_resume_waited;    /* seconds the last resume waited for device memory (a park elsewhere freeing it) */

static void set_error(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(g_error, sizeof g_error, format, args);
    va_end(args);
}

static const char *cu_name(CUresult code) {
    const char *name = NULL;
    if (cu.GetErrorName && cu.GetErrorName(code, &name) == CUDA_SUCCESS && name) return name;
    return "CUresult";
}

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* ---- opening the driver, once ------------------------------------------------------------------------- */

static void *symbol(void *lib, const char *name, int *missing) {
    void *found = dlsym(lib, name);
    if (!found && !*missing) {
        *missing = 1;
        set_error("the CUDA driver has no %s: allocations pass through, nothing parks", name);
    }
    return found;
}

/* libcudart's calls, looked up when first needed: libcudart may be loaded after this library's first call. */
static int resolve_runtime(void) {
    if (!real_cudaMalloc) real_cudaMalloc = (int (*)(void **, size_t))dlsym(RTLD_NEXT, "cudaMalloc");
    if (!real_cudaFree) real_cudaFree = (int (*)(void *))dlsym(RTLD_NEXT, "cudaFree");
    return real_cudaMalloc && real_cudaFree;
}

static void open_driver(void) {
    const char *path = getenv("GQX_PAGES_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        set_error("%s cannot be loaded (%s): allocations pass through, nothing parks", path, dlerror());
        return;
    }
    int missing = 0;
#define LOAD(field, name) *(void **)(&cu.field) = symbol(lib, name, &missing)
    LOAD(Init, "cuInit");
    LOAD(GetErrorName, "cuGetErrorName");
    LOAD(CtxGetCurrent, "cuCtxGetCurrent");
    LOAD(CtxGetDevice, "cuCtxGetDevice");
    LOAD(CtxPushCurrent, "cuCtxPushCurrent_v2");
    LOAD(CtxPopCurrent, "cuCtxPopCurrent_v2");
    LOAD(CtxSynchronize, "cuCtxSynchronize");
    LOAD(MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    LOAD(MemAddressReserve, "cuMemAddressReserve");
    LOAD(MemAddressFree, "cuMemAddressFree");
    LOAD(MemCreate, "cuMemCreate");
    LOAD(MemRelease, "cuMemRelease");
    LOAD(MemMap, "cuMemMap");
    LOAD(MemUnmap, "cuMemUnmap");
    LOAD(MemSetAccess, "cuMemSetAccess");
    LOAD(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    LOAD(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    LOAD(StreamCreate, "cuStreamCreate");
    LOAD(StreamSynchronize, "cuStreamSynchronize");
    LOAD(MemHostRegister, "cuMemHostRegister_v2");
    LOAD(MemHostUnregister, "cuMemHostUnregister");
#undef LOAD
    if (missing) return;
    CUresult code = cu.Init(0);
    if (code != CUDA_SUCCESS) {
        set_error("cuInit(0) failed: %s (%d): allocations pass through, nothing parks", cu_name(code), code);
        return;
    }
    const char *chunk = getenv("GQX_PAGES_CHUNK_BYTES");
    if (chunk && atoll(chunk) > 0) g_chunk = (size_t)atoll(chunk);
    const char *piece_bytes = getenv("GQX_PAGES_PIECE_BYTES");
    if (piece_bytes && atoll(piece_bytes) > 0) g_piece = (size_t)atoll(piece_bytes);
    g_active = 1;
}

static int ensure_open(void) {
    pthread_once(&g_once, open_driver);
    return g_active;
}

/* ---- the table ---------------------------------------------------------------------------------------- */

static mapping *table_add(void) {
    if (g_count == g_capacity) {
        size_t capacity = g_capacity ? g_capacity * 2 : 256;
        mapping *grown = realloc(g_maps, capacity * sizeof *grown);
        if (!grown) return NULL;
        g_maps = grown;
        g_capacity = capacity;
    }
    mapping *m = &g_maps[g_count++];
    memset(m, 0, sizeof *m);
    return m;
}

static mapping *table_find(CUdeviceptr va) {
    /* From the end: torch frees its newest segments first, and a free is rare next to an allocation. */
    for (size_t i = g_count; i-- > 0;)
        if (g_maps[i].va == va) return &g_maps[i];
    return NULL;
}

static void table_remove(mapping *m) {
    free(m->many);
    *m = g_maps[--g_count];
}

static piece *piece_at(mapping *m, size_t j) {
    return m->many ? &m->many[j] : &m->one;
}

static size_t piece_offset(const mapping *m, size_t j) {
    return j * m->piece_bytes;
}

static size_t piece_length(const mapping *m, size_t j) {
    size_t at = piece_offset(m, j);
    return m->padded - at < m->piece_bytes ? m->padded - at : m->piece_bytes;
}

/* The caller's bytes in piece j (the padding at the end is never copied). */
static size_t piece_bytes_used(const mapping *m, size_t j) {
    size_t at = piece_offset(m, j);
    if (at >= m->size) return 0;
    return m->size - at < m->piece_bytes ? m->size - at : m->piece_bytes;
}

static size_t mapping_resident_bytes(mapping *m) {
    size_t total = 0;
    for (size_t j = 0; j < m->npieces; j++)
        if (piece_at(m, j)->resident) total += piece_bytes_used(m, j);
    return total;
}

/* The pieces of a new mapping: pieces of g_piece bytes (rounded to the granularity), one where it is smaller. */
static int cut_into_pieces(mapping *m, size_t g) {
    size_t length = g_piece < m->padded ? g_piece : m->padded;
    m->piece_bytes = (length + g - 1) / g * g;
    m->npieces = (m->padded + m->piece_bytes - 1) / m->piece_bytes;
    if (m->npieces > 1) {
        m->many = calloc(m->npieces, sizeof *m->many);
        if (!m->many) return 0;
    }
    return 1;
}

static void wait_running(void) {
    while (g_state != GQX_RUNNING) pthread_cond_wait(&g_running, &g_mu);
}

/* ---- physical memory ---------------------------------------------------------------------------------- */

static CUmemAllocationProp device_prop(CUdevice dev) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

/* Physical memory for piece j created and mapped at its place, readable and writable by its device; on failure
 * nothing of it stays created or mapped. */
static CUresult back_piece(mapping *m, size_t j) {
    CUmemAllocationProp prop = device_prop(m->dev);
    CUmemGenericAllocationHandle handle = 0;
    CUdeviceptr at = m->va + piece_offset(m, j);
    size_t length = piece_length(m, j);
    CUresult code = cu.MemCreate(&handle, length, &prop, 0);
    if (code != CUDA_SUCCESS) return code;
    code = cu.MemMap(at, length, 0, handle, 0);
    if (code != CUDA_SUCCESS) {
        cu.MemRelease(handle);
        return code;
    }
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = m->dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    code = cu.MemSetAccess(at, length, &access, 1);
    if (code != CUDA_SUCCESS) {
        cu.MemUnmap(at, length);
        cu.MemRelease(handle);
        return code;
    }
    piece *p = piece_at(m, j);
    p->handle = handle;
    p->resident = 1;
    return CUDA_SUCCESS;
}

/* Piece j's physical memory gone (its address range stays reserved). Unmapping first: the memory is freed when
 * it is neither mapped nor held by a handle. */
static CUresult drop_piece(mapping *m, size_t j) {
    piece *p = piece_at(m, j);
    CUresult code = cu.MemUnmap(m->va + piece_offset(m, j), piece_length(m, j));
    if (code != CUDA_SUCCESS) return code;
    p->resident = 0;
    p->fresh = 0;
    return cu.MemRelease(p->handle);
}

/* Every piece backed; on failure the pieces backed here are given back. */
static CUresult back_with_memory(mapping *m) {
    for (size_t j = 0; j < m->npieces; j++) {
        CUresult code = back_piece(m, j);
        if (code != CUDA_SUCCESS) {
            while (j-- > 0) drop_piece(m, j);
            return code;
        }
    }
    return CUDA_SUCCESS;
}

/* Every resident piece gone; the first failure is returned (a piece that will not unmap stays resident). */
static CUresult drop_memory(mapping *m) {
    CUresult first = CUDA_SUCCESS;
    for (size_t j = 0; j < m->npieces; j++) {
        if (!piece_at(m, j)->resident) continue;
        CUresult code = drop_piece(m, j);
        if (code != CUDA_SUCCESS && first == CUDA_SUCCESS) first = code;
    }
    return first;
}

/* ---- the interposed runtime calls --------------------------------------------------------------------- */

static int passthrough_malloc(void **ptr, size_t size) {
    resolve_runtime();
    if (!real_cudaMalloc) return cudaErrorMemoryAllocation;
    return real_cudaMalloc(ptr, size);
}

/* The calling thread's context; a thread whose runtime has not made one current yet gets it made by a
 * cudaFree(NULL) through libcudart (the runtime's classic way to initialise its primary context). */
static CUcontext current_context(void) {
    CUcontext ctx = NULL;
    if (cu.CtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx) return ctx;
    resolve_runtime();
    if (real_cudaFree) real_cudaFree(NULL);
    ctx = NULL;
    if (cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS) return NULL;
    return ctx;
}

static size_t granularity(CUdevice dev) {
    static size_t cached[MAX_CONTEXTS];
    if (dev >= 0 && dev < MAX_CONTEXTS && cached[dev]) return cached[dev];
    CUmemAllocationProp prop = device_prop(dev);
    size_t g = 0;
    if (cu.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g)
        g = (size_t)2 << 20;
    if (dev >= 0 && dev < MAX_CONTEXTS) cached[dev] = g;
    return g;
}

int cudaMalloc(void **ptr, size_t size) {
    if (!ptr) return cudaErrorInvalidValue;
    if (!ensure_open()) return passthrough_malloc(ptr, size);
    if (size == 0) {
        *ptr = NULL;
        return cudaSuccess;
    }
    CUcontext ctx = current_context();
    CUdevice dev = 0;
    if (!ctx || cu.CtxGetDevice(&dev) != CUDA_SUCCESS) return passthrough_malloc(ptr, size);

    pthread_mutex_lock(&g_mu);
    wait_running(); /* a parked process's allocations wait for its resume, as the checkpoint path's do */
    int result = cudaSuccess;
    mapping *m = table_add();
    if (!m) {
        pthread_mutex_unlock(&g_mu);
        return cudaErrorMemoryAllocation;
    }
    size_t g = granularity(dev);
    m->size = size;
    m->padded = (size + g - 1) / g * g;
    m->ctx = ctx;
    m->dev = dev;
    if (!cut_into_pieces(m, g)) {
        table_remove(m);
        pthread_mutex_unlock(&g_mu);
        return cudaErrorMemoryAllocation;
    }
    CUresult code = cu.MemAddressReserve(&m->va, m->padded, g, 0, 0);
    if (code == CUDA_SUCCESS) {
        code = back_with_memory(m);
        if (code != CUDA_SUCCESS) cu.MemAddressFree(m->va, m->padded);
    }
    if (code == CUDA_SUCCESS) {
        g_last_ctx = ctx;
        *ptr = (void *)(uintptr_t)m->va;
    } else if (code == CUDA_ERROR_OUT_OF_MEMORY) {
        table_remove(m);
        result = cudaErrorMemoryAllocation; /* torch frees its cache, retries, then raises OutOfMemoryError */
    } else {
        /* The virtual memory calls refused this device or size: serve it as libcudart would. It works, it
         * just cannot be parked (it stays on the device through a park). */
        set_error("the virtual memory calls refused %llu bytes (%s, %d): served by libcudart, never parked",
                  (unsigned long long)size, cu_name(code), code);
        void *p = NULL;
        result = passthrough_malloc(&p, size);
        if (result == cudaSuccess) {
            m->va = (CUdeviceptr)(uintptr_t)p;
            m->passthrough = 1;
            piece_at(m, 0)->resident = 1; /* for the counts: it is on the device, and stays there */
            *ptr = p;
        } else {
            table_remove(m);
        }
    }
    pthread_mutex_unlock(&g_mu);
    return result;
}

static int passthrough_free(void *ptr) {
    resolve_runtime();
    if (real_cudaFree) return real_cudaFree(ptr);
    return ptr ? cudaErrorInvalidValue : cudaSuccess;
}

int cudaFree(void *ptr) {
    if (!ptr || !ensure_open()) return passthrough_free(ptr);
    pthread_mutex_lock(&g_mu);
    wait_running();
    mapping *m = table_find((CUdeviceptr)(uintptr_t)ptr);
    if (!m || m->passthrough) {
        if (m) table_remove(m);
        pthread_mutex_unlock(&g_mu);
        return passthrough_free(ptr);
    }
    /* cudaFree waits for the device's work; unmapping memory that a kernel still reads would fault it. */
    CUresult code = cu.CtxPushCurrent(m->ctx);
    if (code == CUDA_SUCCESS) {
        code = cu.CtxSynchronize();
        CUcontext popped;
        cu.CtxPopCurrent(&popped);
    }
    if (code == CUDA_SUCCESS) code = drop_memory(m);
    if (code == CUDA_SUCCESS) {
        /* The memory is gone: the allocation is, whatever the address range does (a range that will not
         * be freed is only address space lost, and a later resume must not back it again). */
        cu.MemAddressFree(m->va, m->padded);
        table_remove(m);
    }
    pthread_mutex_unlock(&g_mu);
    return code == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/* ---- copies ------------------------------------------------------------------------------------------- */

static context_streams *streams_for(CUcontext ctx, CUresult *code) {
    for (size_t i = 0; i < g_ctx_count; i++)
        if (g_ctx[i].ctx == ctx) return &g_ctx[i];
    if (g_ctx_count == MAX_CONTEXTS) {
        *code = CUDA_ERROR_INVALID_VALUE;
        return NULL;
    }
    context_streams *s = &g_ctx[g_ctx_count];
    if (s->ctx != ctx) memset(s, 0, sizeof *s); /* a slot left by another context's failed try */
    s->ctx = ctx;
    for (int k = 0; k < 4; k++) {
        if (s->stream[k]) continue; /* made by an earlier try that failed at a later stream */
        *code = cu.StreamCreate(&s->stream[k], CU_STREAM_NON_BLOCKING);
        if (*code != CUDA_SUCCESS) return NULL;
    }
    g_ctx_count++;
    return s;
}

enum direction { TO_HOST, TO_DEVICE };

/* One piece of a mapping, as a park or resume goes through them. */
typedef struct {
    mapping *m;
    size_t j;
} piece_ref;

/* Whether a park moves piece p (it is on the device) or a resume brings it back (the park put it in the arena). */
static int moved_by(const piece *p, enum direction way) {
    return way == TO_HOST ? p->resident : p->parked;
}

/* The pieces a park moves (TO_HOST) or a resume brings back (TO_DEVICE), in the table's order; NULL with *n = 0
 * when there are none, or when the list cannot be had (*n = (size_t)-1). */
static piece_ref *pieces_where(enum direction way, size_t *n) {
    size_t count = 0;
    for (size_t i = 0; i < g_count; i++)
        for (size_t j = 0; !g_maps[i].passthrough && j < g_maps[i].npieces; j++)
            count += moved_by(piece_at(&g_maps[i], j), way);
    *n = count;
    if (!count) return NULL;
    piece_ref *refs = malloc(count * sizeof *refs);
    if (!refs) {
        *n = (size_t)-1;
        return NULL;
    }
    size_t r = 0;
    for (size_t i = 0; i < g_count; i++)
        for (size_t j = 0; !g_maps[i].passthrough && j < g_maps[i].npieces; j++)
            if (moved_by(piece_at(&g_maps[i], j), way)) refs[r++] = (piece_ref){&g_maps[i], j};
    return refs;
}

/* One piece's bytes copied between the device and the arena, in chunks alternating between the two streams of
 * `pair`; issued, not waited for. */
static CUresult copy_piece(struct gqx_arena *arena, piece_ref ref, enum direction way, int pair, const char **what) {
    mapping *m = ref.m;
    size_t used = piece_bytes_used(m, ref.j), base = piece_offset(m, ref.j);
    if (!used) return CUDA_SUCCESS;
    CUresult code = cu.CtxPushCurrent(m->ctx);
    if (code != CUDA_SUCCESS) {
        *what = "cuCtxPushCurrent";
        return code;
    }
    context_streams *s = streams_for(m->ctx, &code);
    unsigned k = 0;
    for (size_t done = 0; s && done < used && code == CUDA_SUCCESS; done += g_chunk, k++) {
        size_t n = used - done < g_chunk ? used - done : g_chunk;
        char *host = arena->base + m->host_offset + base + done;
        CUdeviceptr device = m->va + base + done;
        CUstream stream = s->stream[2 * pair + (int)(k & 1)];
        code = way == TO_HOST ? cu.MemcpyDtoHAsync(host, device, n, stream) : cu.MemcpyHtoDAsync(device, host, n, stream);
    }
    if (code != CUDA_SUCCESS)
        *what = !s ? "cuStreamCreate" : way == TO_HOST ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
    CUcontext popped;
    cu.CtxPopCurrent(&popped);
    return code;
}

/* Every context's streams of `pair` waited for (both pairs: -1). All of them are waited for even after a
 * failure, so that nothing is still moving when the caller undoes its work; the first failure is returned. */
static CUresult wait_streams(int pair, const char **what) {
    CUresult first = CUDA_SUCCESS;
    for (size_t c = 0; c < g_ctx_count; c++) {
        CUresult code = cu.CtxPushCurrent(g_ctx[c].ctx);
        if (code != CUDA_SUCCESS) {
            if (first == CUDA_SUCCESS) first = code, *what = "cuCtxPushCurrent";
            continue;
        }
        for (int k = 0; k < 4; k++) {
            if (pair >= 0 && k / 2 != pair) continue;
            code = cu.StreamSynchronize(g_ctx[c].stream[k]);
            if (code != CUDA_SUCCESS && first == CUDA_SUCCESS) first = code, *what = "cuStreamSynchronize";
        }
        CUcontext popped;
        cu.CtxPopCurrent(&popped);
    }
    return first;
}

/* ---- park and resume ---------------------------------------------------------------------------------- */

static size_t resident_bytes_locked(void) {
    size_t total = 0;
    for (size_t i = 0; i < g_count; i++)
        if (!g_maps[i].passthrough) total += mapping_resident_bytes(&g_maps[i]);
    return total;
}

/* What a park's arena must hold: the whole of every mapping with a piece on the device (its bytes sit at one
 * offset, piece after piece). */
static size_t park_size_locked(void) {
    size_t total = 0;
    for (size_t i = 0; i < g_count; i++)
        if (!g_maps[i].passthrough && mapping_resident_bytes(&g_maps[i])) total += g_maps[i].size;
    return total;
}

static void set_state(int state) {
    __atomic_store_n(&g_state, state, __ATOMIC_RELEASE);
}

/* The device's work first, once per context that holds a resident piece: a kernel still writing a segment
 * would change it behind the copy. */
static CUresult synchronize_contexts(void) {
    CUcontext synced[MAX_CONTEXTS];
    size_t synced_count = 0;
    for (size_t i = 0; i < g_count; i++) {
        mapping *m = &g_maps[i];
        if (m->passthrough || !mapping_resident_bytes(m)) continue;
        size_t c = 0;
        while (c < synced_count && synced[c] != m->ctx) c++;
        if (c < synced_count) continue;
        CUresult code = cu.CtxPushCurrent(m->ctx);
        if (code == CUDA_SUCCESS) {
            code = cu.CtxSynchronize();
            CUcontext popped;
            cu.CtxPopCurrent(&popped);
        }
        if (code != CUDA_SUCCESS) {
            set_error("cuCtxSynchronize failed: %s (%d)", cu_name(code), code);
            return code;
        }
        if (synced_count < MAX_CONTEXTS) synced[synced_count++] = m->ctx;
    }
    return CUDA_SUCCESS;
}

/* A piece whose bytes are in the arena given back to the device; one that will not unmap stays resident
 * (its bytes are in the arena too, and the resume skips it), counted in *kept. */
static void release_copied(piece_ref ref, CUresult *failed, size_t *kept, size_t *released) {
    CUresult code = drop_piece(ref.m, ref.j);
    if (!piece_at(ref.m, ref.j)->resident) piece_at(ref.m, ref.j)->parked = 1; /* unmapped: the arena holds it */
    if (code == CUDA_SUCCESS) {
        (*released)++;
        return;
    }
    if (*failed == CUDA_SUCCESS) *failed = code;
    if (piece_at(ref.m, ref.j)->resident) *kept += piece_length(ref.m, ref.j);
}

int gqx_park(struct gqx_arena *arena, int release_as_copied) {
    if (!ensure_open()) return GQX_E_DRIVER;
    pthread_mutex_lock(&g_mu);
    if (g_state != GQX_RUNNING) {
        set_error("cannot park: already %s", g_state == GQX_PARKED ? "parked" : "moving");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_STATE;
    }
    size_t needed = park_size_locked();
    if (!arena || !arena->registered || arena->size < needed) {
        set_error("cannot park: %llu bytes are mapped, the arena holds %llu", (unsigned long long)needed,
                  (unsigned long long)(arena ? arena->size : 0));
        pthread_mutex_unlock(&g_mu);
        return GQX_E_ARENA;
    }
    size_t n = 0;
    piece_ref *refs = pieces_where(TO_HOST, &n);
    if (n == (size_t)-1) {
        set_error("cannot park: no host memory for the table");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_HOST;
    }
    set_state(GQX_PARKING);
    size_t offset = 0;
    for (size_t i = 0; i < g_count; i++) {
        mapping *m = &g_maps[i];
        if (m->passthrough || !mapping_resident_bytes(m)) continue;
        m->host_offset = offset;
        offset += m->size;
    }

    /* Piece after piece, alternating between the two pairs of streams. Releasing as copied: once piece r is
     * issued, the pair of piece r - 1 is waited for and that piece released, while piece r's copy runs. */
    const char *what = "";
    CUresult code = synchronize_contexts(), failed = CUDA_SUCCESS;
    size_t kept = 0, released = 0, moved = 0;
    for (size_t r = 0; r < n && code == CUDA_SUCCESS; r++) {
        code = copy_piece(arena, refs[r], TO_HOST, (int)(r & 1), &what);
        if (code != CUDA_SUCCESS || !release_as_copied || r == 0) continue;
        code = wait_streams((int)((r - 1) & 1), &what);
        if (code == CUDA_SUCCESS) {
            moved += piece_bytes_used(refs[r - 1].m, refs[r - 1].j);
            release_copied(refs[r - 1], &failed, &kept, &released);
        }
    }
    const char *waiting = "";
    CUresult waited = wait_streams(-1, &waiting);
    if (code == CUDA_SUCCESS && waited != CUDA_SUCCESS) code = waited, what = waiting;
    if (code != CUDA_SUCCESS && what[0]) set_error("%s failed: %s (%d)", what, cu_name(code), code);
    if (code != CUDA_SUCCESS && !released) {
        /* Nothing was released: the process runs on as before. */
        set_state(GQX_RUNNING);
        free(refs);
        pthread_cond_broadcast(&g_running);
        pthread_mutex_unlock(&g_mu);
        return code;
    }
    if (code != CUDA_SUCCESS) {
        /* Released pieces cannot be had back here (their room may be another process's by now): parked in
         * part, and the resume brings back what was released. */
        char cause[sizeof g_error];
        snprintf(cause, sizeof cause, "%s", g_error);
        set_error("parked in part: %llu bytes are in the arena, %llu still on the device (%s); a resume brings "
                  "them all back", (unsigned long long)moved, (unsigned long long)resident_bytes_locked(), cause);
        g_parked_in = arena;
        set_state(GQX_PARKED);
        free(refs);
        pthread_mutex_unlock(&g_mu);
        return GQX_E_PARTIAL;
    }

    /* Every byte is in the arena: what is still on the device can go (all of it, unless released as copied:
     * then the last piece). */
    for (size_t r = release_as_copied && n ? n - 1 : 0; r < n; r++) release_copied(refs[r], &failed, &kept, &released);
    free(refs);
    g_parked_in = arena;
    set_state(GQX_PARKED);
    pthread_mutex_unlock(&g_mu);
    if (failed != CUDA_SUCCESS) {
        set_error("parked, but %llu bytes stayed on the device: cuMemUnmap/cuMemRelease failed: %s (%d)",
                  (unsigned long long)kept, cu_name(failed), failed);
        return failed;
    }
    return CUDA_SUCCESS;
}

static void pause_briefly(void) {
    struct timespec pause = {0, 1000000}; /* 1 ms: a 2 GiB piece of a park under way is released every ~40 ms */
    nanosleep(&pause, NULL);
}

/* Piece `ref` backed; when the device is full, tried again until `deadline` (a park under way in another
 * process is releasing memory piece by piece). The table's lock is let go while waiting: nothing else may
 * change the table meanwhile (allocations and frees wait for the resume), and the library's counters stay
 * answerable. */
static CUresult back_piece_waiting(piece_ref ref, double deadline) {
    CUresult code = cu.CtxPushCurrent(ref.m->ctx);
    if (code != CUDA_SUCCESS) return code;
    code = back_piece(ref.m, ref.j);
    double began = now_seconds();
    int waited = 0;
    while (code == CUDA_ERROR_OUT_OF_MEMORY && now_seconds() < deadline) {
        pthread_mutex_unlock(&g_mu);
        pause_briefly();
        pthread_mutex_lock(&g_mu);
        waited = 1;
        code = back_piece(ref.m, ref.j);
    }
    if (waited) g_resume_waited += now_seconds() - began;
    CUcontext popped;
    cu.CtxPopCurrent(&popped);
    return code;
}

int gqx_resume(unsigned long long wait_ms) {
    if (!ensure_open()) return GQX_E_DRIVER;
    pthread_mutex_lock(&g_mu);
    if (g_state != GQX_PARKED) {
        set_error("cannot resume: not parked");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_STATE;
    }
    size_t n = 0;
    piece_ref *refs = pieces_where(TO_DEVICE, &n);
    if (n == (size_t)-1) {
        set_error("cannot resume: no host memory for the table");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_HOST;
    }
    set_state(GQX_RESUMING);
    g_resume_waited = 0;
    double start = now_seconds(), deadline = start + (double)wait_ms / 1000.0;
    const char *what = "";
    CUresult code = CUDA_SUCCESS;
    /* Each piece copied back as soon as it is backed, alternating between the pairs of streams. A piece still
     * backed (a resume before took it and could not give it back) holds only part of its bytes: copied again. */
    for (size_t r = 0; r < n && code == CUDA_SUCCESS; r++) {
        piece *p = piece_at(refs[r].m, refs[r].j);
        if (!p->resident) {
            code = back_piece_waiting(refs[r], deadline);
            if (code != CUDA_SUCCESS) {
                set_error("cannot resume: physical memory for %llu bytes: %s (%d)%s",
                          (unsigned long long)piece_length(refs[r].m, refs[r].j), cu_name(code), code,
                          code == CUDA_ERROR_OUT_OF_MEMORY && wait_ms ? " after waiting for room" : "");
                break;
            }
            p->fresh = 1;
        }
        code = copy_piece(g_parked_in, refs[r], TO_DEVICE, (int)(r & 1), &what);
        if (code != CUDA_SUCCESS) set_error("%s failed: %s (%d)", what, cu_name(code), code);
    }
    CUresult waited = wait_streams(-1, &what);
    if (code == CUDA_SUCCESS && waited != CUDA_SUCCESS) {
        code = waited;
        set_error("%s failed: %s (%d)", what, cu_name(code), code);
    }
    if (code != CUDA_SUCCESS) {
        /* The host copy is whole: give back every piece this attempt took and stay parked; a later resume can
         * try again. */
        for (size_t r = 0; r < n; r++)
            if (piece_at(refs[r].m, refs[r].j)->fresh) drop_piece(refs[r].m, refs[r].j);
        set_state(GQX_PARKED);
        free(refs);
        pthread_mutex_unlock(&g_mu);
        return code;
    }
    for (size_t r = 0; r < n; r++) piece_at(refs[r].m, refs[r].j)->fresh = piece_at(refs[r].m, refs[r].j)->parked = 0;
    free(refs);
    g_parked_in = NULL;
    set_state(GQX_RUNNING);
    pthread_cond_broadcast(&g_running);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ---- the arena ---------------------------------------------------------------------------------------- */

typedef struct {
    char *start;
    size_t length;
} touch_job;

static void *touch_pages(void *arg) {
    touch_job *job = arg;
    long page = sysconf(_SC_PAGESIZE);
    for (size_t at = 0; at < job->length; at += (size_t)page) job->start[at] = 0;
    return NULL;
}

/* Every page of the range faulted in by several threads at once: the kernel zeroes pages at a few GB/s
 * per thread, and pinning an untouched range is far slower than pinning a touched one. */
static void touch_in_parallel(char *base, size_t size) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus > 16 ? 16 : cpus < 1 ? 1 : (int)cpus;
    size_t share = (size + (size_t)threads - 1) / (size_t)threads;
    share = (share + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    pthread_t ids[16];
    touch_job jobs[16];
    int started = 0;
    for (int t = 0; t < threads; t++) {
        size_t from = (size_t)t * share;
        if (from >= size) break;
        jobs[t].start = base + from;
        jobs[t].length = size - from < share ? size - from : share;
        if (pthread_create(&ids[t], NULL, touch_pages, &jobs[t]) != 0) {
            touch_pages(&jobs[t]);
            continue;
        }
        started |= 1 << t;
    }
    for (int t = 0; t < threads; t++)
        if (started & (1 << t)) pthread_join(ids[t], NULL);
}

/* Pinning and unpinning need a context: the calling thread's, else the one the last allocation ran in (a park
 * is asked from a thread of its own, which has none). `*pushed` says whether leave_context must pop it. */
static int enter_some_context(int *pushed) {
    CUcontext current = NULL;
    *pushed = 0;
    if (cu.CtxGetCurrent(&current) == CUDA_SUCCESS && current) return 1;
    pthread_mutex_lock(&g_mu);
    CUcontext last = g_last_ctx;
    pthread_mutex_unlock(&g_mu);
    if (!last || cu.CtxPushCurrent(last) != CUDA_SUCCESS) return 0;
    *pushed = 1;
    return 1;
}

static void leave_context(int pushed) {
    CUcontext popped;
    if (pushed) cu.CtxPopCurrent(&popped);
}

int gqx_arena_create(size_t size, struct gqx_arena **out) {
    if (!out) return GQX_E_ARENA;
    *out = NULL;
    if (!ensure_open()) return GQX_E_DRIVER;
    struct gqx_arena *arena = calloc(1, sizeof *arena);
    if (!arena) {
        set_error("no host memory for the arena's record");
        return GQX_E_HOST;
    }
    size_t rounded = ((size ? size : 1) + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    double start = now_seconds();
    void *base = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        set_error("mmap of %llu bytes for the arena failed: %s", (unsigned long long)rounded, strerror(errno));
        free(arena);
        return GQX_E_HOST;
    }
    madvise(base, rounded, MADV_HUGEPAGE); /* fewer pages to fault and to pin, where the kernel allows it */
    touch_in_parallel(base, rounded);
    arena->populate_seconds = now_seconds() - start;

    int pushed = 0;
    if (!enter_some_context(&pushed)) {
        set_error("no CUDA context yet: allocate on the device before making an arena");
        munmap(base, rounded);
        free(arena);
        return GQX_E_CONTEXT;
    }
    start = now_seconds();
    CUresult code = cu.MemHostRegister(base, rounded, CU_MEMHOSTREGISTER_PORTABLE);
    arena->register_seconds = now_seconds() - start;
    leave_context(pushed);
    if (code != CUDA_SUCCESS) {
        set_error("cuMemHostRegister of %llu bytes failed: %s (%d)", (unsigned long long)rounded, cu_name(code),
                  code);
        munmap(base, rounded);
        free(arena);
        return code;
    }
    arena->base = base;
    arena->size = rounded;
    arena->registered = 1;
    *out = arena;
    return CUDA_SUCCESS;
}

int gqx_arena_destroy(struct gqx_arena *arena) {
    if (!arena) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    int holding = g_state != GQX_RUNNING && g_parked_in == arena;
    pthread_mutex_unlock(&g_mu);
    if (holding) {
        set_error("the arena holds a parked process's bytes: resume first");
        return GQX_E_STATE;
    }
    if (arena->registered && ensure_open()) {
        int pushed = 0;
        CUresult code = enter_some_context(&pushed) ? cu.MemHostUnregister(arena->base) : GQX_E_CONTEXT;
        leave_context(pushed);
        if (code != CUDA_SUCCESS) {
            /* Unmapping memory the driver still has pinned would leave it pinned and unreachable: keep it. */
            set_error("cuMemHostUnregister failed: %s (%d); the arena is kept", cu_name(code), code);
            return code;
        }
    }
    munmap(arena->base, arena->size);
    free(arena);
    return CUDA_SUCCESS;
}

unsigned long long gqx_arena_size(const struct gqx_arena *arena) { return arena ? arena->size : 0; }
double gqx_arena_populate_seconds(const struct gqx_arena *arena) { return arena ? arena->populate_seconds : 0; }
double gqx_arena_register_seconds(const struct gqx_arena *arena) { return arena ? arena->register_seconds : 0; }

/* ---- what the caller can ask -------------------------------------------------------------------------- */

int gqx_active(void) { return ensure_open(); }

/* Read without the table's lock: a resume waiting for room holds it between its tries, and the kernel asks the
 * state before every cell. */
int gqx_state(void) {
    return __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
}

/* Bytes this library holds on the device now (parked mappings count nothing). */
unsigned long long gqx_resident_bytes(void) {
    pthread_mutex_lock(&g_mu);
    size_t total = resident_bytes_locked();
    pthread_mutex_unlock(&g_mu);
    return total;
}

/* Bytes a park moves (resident now) or moved (parked now): the arena must hold at least this. */
unsigned long long gqx_mapped_bytes(void) {
    pthread_mutex_lock(&g_mu);
    size_t total = 0;
    for (size_t i = 0; i < g_count; i++)
        if (!g_maps[i].passthrough) total += g_maps[i].size;
    pthread_mutex_unlock(&g_mu);
    return total;
}

/* Bytes served by libcudart instead (the virtual memory calls refused them): they never park. */
unsigned long long gqx_passthrough_bytes(void) {
    pthread_mutex_lock(&g_mu);
    size_t total = 0;
    for (size_t i = 0; i < g_count; i++)
        if (g_maps[i].passthrough) total += g_maps[i].size;
    pthread_mutex_unlock(&g_mu);
    return total;
}

unsigned long long gqx_mapping_count(void) {
    pthread_mutex_lock(&g_mu);
    size_t count = g_count;
    pthread_mutex_unlock(&g_mu);
    return count;
}

const char *gqx_last_error(void) { return g_error; }

/* Seconds the last resume spent waiting for device memory (0: it found its room there, or did not wait). */
double gqx_resume_waited_seconds(void) {
    pthread_mutex_lock(&g_mu);
    double waited = g_resume_waited;
    pthread_mutex_unlock(&g_mu);
    return waited;
}
