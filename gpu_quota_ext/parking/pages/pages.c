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
 * gqx_park(arena) copies every mapping's bytes to one pinned host arena (made once by gqx_arena_create,
 * kept and reused: pinning costs more than copying), then unmaps and releases the physical memory; the
 * address ranges stay reserved. gqx_resume() creates physical memory again, maps it at the same addresses
 * and copies the bytes back. Copies go in large chunks on two streams.
 *
 * What a failure leaves: a park releases nothing until every byte is in the arena; a resume keeps the host
 * copy (and the parked state) until every byte is back; on any failure the process stays as it was, and the
 * call returns a code and a message (gqx_last_error).
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
    CUdeviceptr va;     /* where the caller sees it; never changes */
    size_t size;        /* what the caller asked for */
    size_t padded;      /* size rounded up to the granularity: what is reserved, created and mapped */
    CUcontext ctx;      /* the context current at allocation: copies for this mapping run in it */
    CUdevice dev;
    CUmemGenericAllocationHandle handle;
    int resident;       /* physical memory mapped at va (0 only while parked) */
    int passthrough;    /* served by libcudart (the driver path failed): freed there, never parked */
    size_t host_offset; /* where its bytes sit in the arena while parked */
} mapping;

typedef struct {
    CUcontext ctx;
    CUstream stream[2];
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
static char g_error[512];

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
    *m = g_maps[--g_count];
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

/* Physical memory created and mapped at m->va, readable and writable by its device; on failure nothing
 * stays created or mapped. */
static CUresult back_with_memory(mapping *m) {
    CUmemAllocationProp prop = device_prop(m->dev);
    CUmemGenericAllocationHandle handle = 0;
    CUresult code = cu.MemCreate(&handle, m->padded, &prop, 0);
    if (code != CUDA_SUCCESS) return code;
    code = cu.MemMap(m->va, m->padded, 0, handle, 0);
    if (code != CUDA_SUCCESS) {
        cu.MemRelease(handle);
        return code;
    }
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = m->dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    code = cu.MemSetAccess(m->va, m->padded, &access, 1);
    if (code != CUDA_SUCCESS) {
        cu.MemUnmap(m->va, m->padded);
        cu.MemRelease(handle);
        return code;
    }
    m->handle = handle;
    m->resident = 1;
    return CUDA_SUCCESS;
}

/* The physical memory gone (the address range stays reserved). Unmapping first: the memory is freed when
 * it is neither mapped nor held by a handle. */
static CUresult drop_memory(mapping *m) {
    CUresult code = cu.MemUnmap(m->va, m->padded);
    if (code != CUDA_SUCCESS) return code;
    m->resident = 0;
    return cu.MemRelease(m->handle);
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
            m->resident = 1;
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
    s->ctx = ctx;
    for (int k = 0; k < 2; k++) {
        *code = cu.StreamCreate(&s->stream[k], CU_STREAM_NON_BLOCKING);
        if (*code != CUDA_SUCCESS) return NULL; /* the stream made so far is kept for the next try */
    }
    g_ctx_count++;
    return s;
}

enum direction { TO_HOST, TO_DEVICE };

/* Every selected mapping's bytes copied between the device and the arena, in chunks alternating between
 * two streams per context, then waited for. `select` says which mappings: resident ones for a park, the
 * ones just backed again for a resume. Returns the first failure (the copies already issued are waited
 * for all the same, so that nothing is still moving when the caller undoes its work). */
static CUresult copy_all(struct gqx_arena *arena, enum direction way, const unsigned char *select) {
    CUresult first = CUDA_SUCCESS;
    const char *what = "";
    unsigned k = 0;
    for (size_t i = 0; i < g_count && first == CUDA_SUCCESS; i++) {
        mapping *m = &g_maps[i];
        if (!select[i]) continue;
        CUresult code = cu.CtxPushCurrent(m->ctx);
        if (code != CUDA_SUCCESS) {
            first = code, what = "cuCtxPushCurrent";
            break;
        }
        context_streams *s = streams_for(m->ctx, &code);
        for (size_t done = 0; s && done < m->size && code == CUDA_SUCCESS; done += g_chunk, k++) {
            size_t n = m->size - done < g_chunk ? m->size - done : g_chunk;
            char *host = arena->base + m->host_offset + done;
            CUstream stream = s->stream[k & 1];
            if (way == TO_HOST)
                code = cu.MemcpyDtoHAsync(host, m->va + done, n, stream);
            else
                code = cu.MemcpyHtoDAsync(m->va + done, host, n, stream);
        }
        if (code != CUDA_SUCCESS) {
            first = code;
            what = !s ? "cuStreamCreate" : way == TO_HOST ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
        }
        CUcontext popped;
        cu.CtxPopCurrent(&popped);
    }
    for (size_t c = 0; c < g_ctx_count; c++) {
        CUresult code = cu.CtxPushCurrent(g_ctx[c].ctx);
        if (code != CUDA_SUCCESS) {
            if (first == CUDA_SUCCESS) first = code, what = "cuCtxPushCurrent";
            continue;
        }
        for (int j = 0; j < 2; j++) {
            code = cu.StreamSynchronize(g_ctx[c].stream[j]);
            if (code != CUDA_SUCCESS && first == CUDA_SUCCESS) first = code, what = "cuStreamSynchronize";
        }
        CUcontext popped;
        cu.CtxPopCurrent(&popped);
    }
    if (first != CUDA_SUCCESS)
        set_error("%s failed: %s (%d)", what, cu_name(first), first);
    return first;
}

/* ---- park and resume ---------------------------------------------------------------------------------- */

static size_t resident_bytes_locked(void) {
    size_t total = 0;
    for (size_t i = 0; i < g_count; i++)
        if (g_maps[i].resident && !g_maps[i].passthrough) total += g_maps[i].size;
    return total;
}

static unsigned char *new_selection(void) {
    return calloc(g_count ? g_count : 1, 1);
}

int gqx_park(struct gqx_arena *arena) {
    if (!ensure_open()) return GQX_E_DRIVER;
    pthread_mutex_lock(&g_mu);
    if (g_state != GQX_RUNNING) {
        set_error("cannot park: already %s", g_state == GQX_PARKED ? "parked" : "moving");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_STATE;
    }
    size_t needed = resident_bytes_locked();
    if (!arena || !arena->registered || arena->size < needed) {
        set_error("cannot park: %llu bytes are mapped, the arena holds %llu", (unsigned long long)needed,
                  (unsigned long long)(arena ? arena->size : 0));
        pthread_mutex_unlock(&g_mu);
        return GQX_E_ARENA;
    }
    unsigned char *select = new_selection();
    if (!select) {
        set_error("cannot park: no host memory for the table");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_HOST;
    }
    g_state = GQX_PARKING;

    /* The device's work first, once per context: a kernel still writing a segment would change it behind
     * the copy. */
    CUresult code = CUDA_SUCCESS;
    CUcontext synced[MAX_CONTEXTS];
    size_t synced_count = 0;
    for (size_t i = 0; i < g_count && code == CUDA_SUCCESS; i++) {
        mapping *m = &g_maps[i];
        if (!m->resident || m->passthrough) continue;
        size_t c = 0;
        while (c < synced_count && synced[c] != m->ctx) c++;
        if (c < synced_count) continue;
        code = cu.CtxPushCurrent(m->ctx);
        if (code == CUDA_SUCCESS) {
            code = cu.CtxSynchronize();
            CUcontext popped;
            cu.CtxPopCurrent(&popped);
        }
        if (code != CUDA_SUCCESS)
            set_error("cuCtxSynchronize failed: %s (%d)", cu_name(code), code);
        else if (synced_count < MAX_CONTEXTS)
            synced[synced_count++] = m->ctx;
    }
    size_t offset = 0;
    for (size_t i = 0; i < g_count; i++) {
        mapping *m = &g_maps[i];
        if (!m->resident || m->passthrough) continue;
        m->host_offset = offset;
        offset += m->size;
        select[i] = 1;
    }
    if (code == CUDA_SUCCESS) code = copy_all(arena, TO_HOST, select);
    if (code != CUDA_SUCCESS) {
        /* Nothing was released: the process runs on as before. */
        g_state = GQX_RUNNING;
        free(select);
        pthread_cond_broadcast(&g_running);
        pthread_mutex_unlock(&g_mu);
        return code;
    }

    /* Every byte is in the arena: the physical memory can go. A mapping that will not unmap keeps its
     * memory and its bytes (resident); the resume skips it. */
    CUresult failed = CUDA_SUCCESS;
    size_t kept = 0;
    for (size_t i = 0; i < g_count; i++) {
        if (!select[i]) continue;
        CUresult drop = drop_memory(&g_maps[i]);
        if (drop != CUDA_SUCCESS) {
            if (failed == CUDA_SUCCESS) failed = drop;
            if (g_maps[i].resident) kept += g_maps[i].padded;
        }
    }
    free(select);
    g_parked_in = arena;
    g_state = GQX_PARKED;
    pthread_mutex_unlock(&g_mu);
    if (failed != CUDA_SUCCESS) {
        set_error("parked, but %llu bytes stayed on the device: cuMemUnmap/cuMemRelease failed: %s (%d)",
                  (unsigned long long)kept, cu_name(failed), failed);
        return failed;
    }
    return CUDA_SUCCESS;
}

int gqx_resume(void) {
    if (!ensure_open()) return GQX_E_DRIVER;
    pthread_mutex_lock(&g_mu);
    if (g_state != GQX_PARKED) {
        set_error("cannot resume: not parked");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_STATE;
    }
    unsigned char *select = new_selection();
    if (!select) {
        set_error("cannot resume: no host memory for the table");
        pthread_mutex_unlock(&g_mu);
        return GQX_E_HOST;
    }
    g_state = GQX_RESUMING;
    CUresult code = CUDA_SUCCESS;
    for (size_t i = 0; i < g_count && code == CUDA_SUCCESS; i++) {
        mapping *m = &g_maps[i];
        if (m->resident || m->passthrough) continue;
        code = cu.CtxPushCurrent(m->ctx);
        if (code == CUDA_SUCCESS) {
            code = back_with_memory(m);
            CUcontext popped;
            cu.CtxPopCurrent(&popped);
        }
        if (code == CUDA_SUCCESS)
            select[i] = 1;
        else
            set_error("cannot resume: physical memory for %llu bytes: %s (%d)", (unsigned long long)m->padded,
                      cu_name(code), code);
    }
    if (code == CUDA_SUCCESS) code = copy_all(g_parked_in, TO_DEVICE, select);
    if (code != CUDA_SUCCESS) {
        /* The host copy is whole: give back what this attempt took and stay parked; a later resume can
         * try again. */
        for (size_t i = 0; i < g_count; i++)
            if (select[i]) drop_memory(&g_maps[i]);
        g_state = GQX_PARKED;
        free(select);
        pthread_mutex_unlock(&g_mu);
        return code;
    }
    free(select);
    g_parked_in = NULL;
    g_state = GQX_RUNNING;
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

int gqx_state(void) {
    pthread_mutex_lock(&g_mu);
    int state = g_state;
    pthread_mutex_unlock(&g_mu);
    return state;
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
