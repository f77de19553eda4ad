/*
 * A fake libcudart for the fast park library's tests: the cudaMalloc and cudaFree that the library passes
 * through to (found after it in the lookup order, as the real libcudart is after a preloaded library). Host
 * memory, counted, so that a test sees what went through.
 */

#include <stdlib.h>

static long mallocs, frees, null_frees;

int cudaMalloc(void **ptr, size_t size) {
    mallocs++;
    *ptr = malloc(size ? size : 1);
    return *ptr ? 0 : 2;
}

int cudaFree(void *ptr) {
    if (!ptr) {
        null_frees++; /* the runtime's way to make its context: the library calls it when it finds none */
        return 0;
    }
    frees++;
    free(ptr);
    return 0;
}

long fake_cudart_mallocs(void) { return mallocs; }
long fake_cudart_frees(void) { return frees; }
long fake_cudart_null_frees(void) { return null_frees; }
