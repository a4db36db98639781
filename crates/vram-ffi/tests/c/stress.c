/* Uses libvram.so from several threads: allocations of random sizes with patterns written and
 * checked, frees on other threads than the allocating one, and allocations past the tenant's limit
 * that must come back NULL with a reason. Exits 0 only if everything held. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vram.h"

#define THREADS 6
#define ROUNDS 2000
#define SLOTS 64

struct block { unsigned char *p; size_t n; unsigned char tag; };
static struct block shared[THREADS][SLOTS];
static pthread_mutex_t locks[THREADS];
static int failures;

static uint64_t next(uint64_t *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static int check(struct block *b) {
  size_t edge = b->n < 64 ? b->n : 64;
  for (size_t i = 0; i < edge; i++)
    if (b->p[i] != b->tag || b->p[b->n - 1 - i] != b->tag) return 0;
  return 1;
}

static void *worker(void *arg) {
  int t = (int)(intptr_t)arg;
  uint64_t s = 0x9E3779B97F4A7C15ull * (t + 1);
  void *stream = (void *)(intptr_t)(t % 2);
  for (int r = 0; r < ROUNDS; r++) {
    size_t n = 1 + next(&s) % ((next(&s) % 10 == 0) ? (8u << 20) : 65536);
    unsigned char *p = vram_alloc((ssize_t)n, 0, stream);
    if (!p) { fprintf(stderr, "thread %d: unexpected NULL: %s\n", t, vram_last_error()); __sync_fetch_and_add(&failures, 1); continue; }
    unsigned char tag = (unsigned char)next(&s);
    size_t edge = n < 64 ? n : 64;
    memset(p, tag, edge);
    memset(p + n - edge, tag, edge);
    /* Swap into a slot of the next thread; whatever was there is checked and freed here. */
    int o = (t + 1) % THREADS, k = (int)(next(&s) % SLOTS);
    pthread_mutex_lock(&locks[o]);
    struct block old = shared[o][k];
    shared[o][k] = (struct block){p, n, tag};
    pthread_mutex_unlock(&locks[o]);
    if (old.p) {
      if (!check(&old)) { fprintf(stderr, "thread %d: pattern lost at %p\n", t, (void *)old.p); __sync_fetch_and_add(&failures, 1); }
      vram_free(old.p, (ssize_t)old.n, 0, stream);
    }
  }
  return NULL;
}

int main(void) {
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_mutex_init(&locks[i], NULL);
  for (intptr_t i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, worker, (void *)i);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < THREADS; i++)
    for (int k = 0; k < SLOTS; k++)
      if (shared[i][k].p) {
        if (!check(&shared[i][k])) { fprintf(stderr, "final pattern lost\n"); failures++; }
        vram_free(shared[i][k].p, (ssize_t)shared[i][k].n, 0, NULL);
      }
  /* Past the limit: a clean NULL with the numbers, not a crash. */
  void *huge = vram_alloc((ssize_t)1 << 40, 0, NULL);
  const char *err = vram_last_error();
  if (huge || !err || !strstr(err, "limit")) { fprintf(stderr, "1 TiB was not refused cleanly: %s\n", err ? err : "(no error)"); failures++; }
  else printf("refused as expected: %s\n", err);
  /* A bad free is reported, not fatal. */
  vram_free((void *)0x1234, 8, 0, NULL);
  if (!vram_last_error() || !strstr(vram_last_error(), "not allocated")) { fprintf(stderr, "bad free not reported\n"); failures++; }
  if (vram_trim() < 0) { fprintf(stderr, "trim failed: %s\n", vram_last_error()); failures++; }
  char *stats = vram_stats_json();
  if (!stats) { fprintf(stderr, "no stats: %s\n", vram_last_error()); failures++; }
  else { printf("%s\n", stats); vram_string_free(stats); }
  printf("failures: %d\n", failures);
  return failures == 0 ? 0 : 1;
}
