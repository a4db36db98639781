/* vram_init from C: the options in vram_options_t, none from the environment. argv[1] is the
 * daemon's socket. The struct's layout is the one libvram.so reads (56 bytes, in this order). */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "vram.h"

_Static_assert(sizeof(vram_options_t) == 56, "vram_options_t's first version is 56 bytes");
_Static_assert(offsetof(vram_options_t, socket) == 8, "socket after size and flags");
_Static_assert(offsetof(vram_options_t, guarantee) == 32, "sizes after the strings");
_Static_assert(offsetof(vram_options_t, gpu) == 48, "gpu after the sizes");

static int fail(const char *what) {
  printf("FAILED %s: %s\n", what, vram_last_error() ? vram_last_error() : "(no error)");
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  vram_options_t o;
  memset(&o, 0, sizeof o);
  o.size = sizeof o;
  o.socket = argv[1];
  o.tenant = "c-init";
  o.limit = 64ull << 20;
  o.flags = VRAM_OPTION_GPU;
  o.gpu = 0;

  vram_options_t bad = o;
  bad.size = 16;
  if (vram_init(&bad) != -1) return fail("a 16-byte struct was taken");
  printf("refused as expected: %s\n", vram_last_error());

  if (vram_init(&o) != 0) return fail("vram_init");
  if (vram_init(&o) != VRAM_ERR_CONNECTED) return fail("a second vram_init was taken");
  printf("second init: %s\n", vram_last_error());

  char *stats = vram_stats_json();
  if (!stats) return fail("stats");
  printf("stats: %s\n", stats);
  vram_string_free(stats);
  if (vram_alloc(128 << 20, 0, NULL) != NULL) return fail("128 MiB past a 64 MiB limit");
  void *p = vram_alloc(8 << 20, 0, NULL);
  if (!p) return fail("alloc");
  vram_free(p, 8 << 20, 0, NULL);
  printf("init: ok\n");
  return 0;
}
