/* Shared buffers through libvram.so: a writer and a reader in one process (two handles). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "vram.h"

#define MIB (1024 * 1024)

static int fail(const char *what) {
  printf("FAILED %s: %s\n", what, vram_last_error() ? vram_last_error() : "(no error)");
  return 1;
}

int main(void) {
  vram_shared_t *w = vram_shared_create("c-weights", 3 * MIB, "*", NULL);
  if (!w) return fail("create");
  if (vram_shared_lease(w, 1000) != 0) return fail("lease");
  uint64_t v1 = 0, v2 = 0, sum = 0;
  unsigned char *p = vram_shared_begin_write(w, 0, &v1);
  if (!p) return fail("begin_write");
  memset(p, 0x5a, 4 * MIB); /* rounded up to 4 MiB */
  if (vram_shared_publish(w, &sum) != 0) return fail("publish");

  vram_shared_t *r = vram_shared_open("c-weights");
  if (!r) return fail("open");
  uint64_t pv = 0, psum = 0, size = 0;
  const unsigned char *q = vram_shared_pin(r, &pv, &psum, &size);
  if (!q) return fail("pin");
  if (pv != v1 || psum != sum || size != 4 * MIB || q[size - 1] != 0x5a) {
    printf("FAILED pinned v%llu sum %llx size %llu\n", (unsigned long long)pv,
           (unsigned long long)psum, (unsigned long long)size);
    return 1;
  }
  /* A stale base is a conflict naming the current version. */
  if (vram_shared_begin_write(w, 0, &v2) != NULL) return fail("stale base accepted");
  printf("conflict as expected: %s\n", vram_last_error());
  p = vram_shared_begin_write(w, v1, &v2);
  if (!p) return fail("begin_write v2");
  memset(p, 0x33, 4 * MIB);
  if (vram_shared_publish(w, NULL) != 0) return fail("publish v2");
  uint64_t newer = 0;
  if (vram_shared_wait(r, v1, 1000, &newer) != 1 || newer != v2) return fail("wait");
  if (vram_shared_wait(r, v2, 50, &newer) != 0) return fail("wait timeout");
  /* The reader still has v1, intact. */
  if (q[0] != 0x5a || vram_shared_verify(r, v1) != 1) return fail("v1 kept");
  if (vram_shared_release(r, q) != 0) return fail("release");
  vram_shared_close(r);
  if (vram_shared_release_lease(w) != 0) return fail("release lease");
  vram_shared_close(w);
  printf("shared: ok, v%llu then v%llu\n", (unsigned long long)v1, (unsigned long long)v2);
  return 0;
}
