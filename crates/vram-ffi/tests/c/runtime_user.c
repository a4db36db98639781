/* A library that links the CUDA runtime (here the stand-in, fake_cudart.c), as a Python
 * extension does: local_runtime.c loads it with RTLD_LOCAL, so the runtime it needs is loaded
 * outside the global lookup scope, where RTLD_NEXT does not search. */
#include <stddef.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

int user_malloc(void **ptr, size_t size) { return cudaMalloc(ptr, size); }
int user_free(void *ptr) { return cudaFree(ptr); }
