/* The CUDA driver API as a tenant, with no CUDA headers: dlopen("libcuda.so.1"), cuInit, device 0,
 * its primary context retained and made current, cuMemGetInfo_v2, then cuMemAlloc_v2 in steps until
 * refused (CUDA_ERROR_OUT_OF_MEMORY = 2 expected) or --max-bytes, every block written with
 * cuMemsetD8_v2 and read back (1 MiB at its start, middle and end) with cuMemcpyDtoH_v2; after the
 * refusal, one block is written and read again (the process survives). Prints one JSON line, then
 * "READY <pid>"; with --wait it sleeps until killed.
 *
 *   gcc -O1 -o drv_alloc drv_alloc.c -ldl
 *   ./drv_alloc [--step-mib 256] [--max-bytes 4GiB] [--wait]
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);

#define MIB (1ULL << 20)
#define SAMPLE MIB
#define MAX_BLOCKS 4096

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static unsigned long long parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  while (*end == ' ') end++;
  unsigned long long m = 1;
  if (!strcasecmp(end, "k") || !strcasecmp(end, "kib")) m = 1ULL << 10;
  else if (!strcasecmp(end, "m") || !strcasecmp(end, "mib")) m = 1ULL << 20;
  else if (!strcasecmp(end, "g") || !strcasecmp(end, "gib")) m = 1ULL << 30;
  else if (!strcasecmp(end, "t") || !strcasecmp(end, "tib")) m = 1ULL << 40;
  else if (*end && strcasecmp(end, "b")) {
    fprintf(stderr, "not a size: %s\n", s);
    exit(2);
  }
  return (unsigned long long)(v * (double)m);
}

static const char *errname(CUresult r) {
  const char *n = NULL;
  if (p_cuGetErrorName && p_cuGetErrorName(r, &n) == 0 && n) return n;
  return "?";
}

static void *sym(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) {
    printf("{\"prog\":\"drv_alloc\",\"pid\":%d,\"fatal\":\"dlsym %s failed\"}\n", (int)getpid(), name);
    fflush(stdout);
    exit(3);
  }
  return p;
}

/* Fills the block with its pattern and checks 1 MiB at its start, middle and end. */
static int write_verify(CUdeviceptr p, size_t bytes, unsigned char pat, unsigned char *host) {
  if (p_cuMemsetD8(p, pat, bytes)) return 0;
  if (p_cuCtxSynchronize()) return 0;
  size_t n = bytes < SAMPLE ? bytes : SAMPLE;
  size_t offs[3] = {0, (bytes / 2) & ~(size_t)4095, bytes - n};
  for (int k = 0; k < 3; k++) {
    if (offs[k] + n > bytes) offs[k] = bytes - n;
    memset(host, pat ^ 0xff, n);
    if (p_cuMemcpyDtoH(host, p + offs[k], n)) return 0;
    for (size_t i = 0; i < n; i++)
      if (host[i] != pat) return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  unsigned long long step = 256 * MIB, max_bytes = 1ULL << 40;
  int wait = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--step-mib") && i + 1 < argc) step = strtoull(argv[++i], NULL, 10) * MIB;
    else if (!strcmp(argv[i], "--max-bytes") && i + 1 < argc) max_bytes = parse_size(argv[++i]);
    else if (!strcmp(argv[i], "--wait")) wait = 1;
    else {
      fprintf(stderr, "usage: %s [--step-mib N] [--max-bytes SIZE] [--wait]\n", argv[0]);
      return 2;
    }
  }
  double t0 = now();
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    printf("{\"prog\":\"drv_alloc\",\"pid\":%d,\"fatal\":\"dlopen libcuda.so.1 failed\"}\n", (int)getpid());
    return 3;
  }
  p_cuInit = sym(lib, "cuInit");
  p_cuDeviceGet = sym(lib, "cuDeviceGet");
  p_cuDevicePrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
  p_cuCtxSetCurrent = sym(lib, "cuCtxSetCurrent");
  p_cuCtxSynchronize = sym(lib, "cuCtxSynchronize");
  p_cuMemGetInfo = sym(lib, "cuMemGetInfo_v2");
  p_cuMemAlloc = sym(lib, "cuMemAlloc_v2");
  p_cuMemFree = sym(lib, "cuMemFree_v2");
  p_cuMemsetD8 = sym(lib, "cuMemsetD8_v2");
  p_cuMemcpyDtoH = sym(lib, "cuMemcpyDtoH_v2");
  p_cuGetErrorName = dlsym(lib, "cuGetErrorName");

  CUdevice dev;
  CUcontext ctx;
  CUresult r = p_cuInit(0);
  if (!r) r = p_cuDeviceGet(&dev, 0);
  if (!r) r = p_cuDevicePrimaryCtxRetain(&ctx, dev);
  if (!r) r = p_cuCtxSetCurrent(ctx);
  if (r) {
    printf("{\"prog\":\"drv_alloc\",\"pid\":%d,\"fatal\":\"init failed: %d %s\"}\n", (int)getpid(), r,
           errname(r));
    return 3;
  }
  size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0, free2 = 0, total2 = 0;
  CUresult gi0 = p_cuMemGetInfo(&free0, &total0);

  static CUdeviceptr blocks[MAX_BLOCKS];
  unsigned char *host = malloc(SAMPLE);
  int n = 0, verified = 1, refused = 0;
  CUresult err = 0;
  while (n < MAX_BLOCKS && (unsigned long long)(n + 1) * step <= max_bytes) {
    CUdeviceptr p = 0;
    r = p_cuMemAlloc(&p, step);
    if (r) {
      refused = 1;
      err = r;
      break;
    }
    blocks[n] = p;
    if (!write_verify(p, step, (unsigned char)(0x11 + n), host)) verified = 0;
    n++;
  }
  double alloc_s = now() - t0;
  int blocks_at_refusal = n;
  CUresult gi1 = p_cuMemGetInfo(&free1, &total1);
  /* Survival: the first block written and read again; then the last freed and 2 MiB allocated,
   * written and read. */
  int survived = n > 0 ? write_verify(blocks[0], step, 0xa5, host) : 1;
  int realloc_ok = -1;
  if (n > 0 && p_cuMemFree(blocks[n - 1]) == 0) {
    CUdeviceptr p = 0;
    n--;
    realloc_ok = p_cuMemAlloc(&p, 2 * MIB) == 0 && write_verify(p, 2 * MIB, 0x3c, host);
    if (realloc_ok) blocks[n++] = p;
  }
  CUresult gi2 = p_cuMemGetInfo(&free2, &total2);
  printf("{\"prog\":\"drv_alloc\",\"pid\":%d,\"step\":%llu,\"max_bytes\":%llu,"
         "\"mem_get_info_start\":{\"rc\":%d,\"free\":%zu,\"total\":%zu},"
         "\"mem_get_info_at_refusal\":{\"rc\":%d,\"free\":%zu,\"total\":%zu},"
         "\"mem_get_info_end\":{\"rc\":%d,\"free\":%zu,\"total\":%zu},"
         "\"refused\":%s,\"error_code\":%d,\"error\":\"%s\",\"framework_oom\":%s,"
         "\"blocks\":%d,\"allocated_bytes\":%llu,\"verified\":%s,\"survived\":%s,"
         "\"realloc_after_free_ok\":%s,\"alloc_seconds\":%.3f}\n",
         (int)getpid(), step, max_bytes, gi0, free0, total0, gi1, free1, total1, gi2, free2, total2,
         refused ? "true" : "false", err, refused ? errname(err) : "", refused && err == 2 ? "true" : "false",
         blocks_at_refusal, (unsigned long long)blocks_at_refusal * step, verified ? "true" : "false",
         survived ? "true" : "false", realloc_ok < 0 ? "null" : realloc_ok ? "true" : "false", alloc_s);
  printf("READY %d\n", (int)getpid());
  fflush(stdout);
  if (wait)
    for (;;) pause();
  for (int i = 0; i < n; i++) p_cuMemFree(blocks[i]);
  free(host);
  return 0;
}
