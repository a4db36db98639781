/* The C tests' check: on a false condition, the line, the condition and libvram's last error
 * are printed and the calling function returns 1. Include after vram.h and stdio.h. */
#ifndef VRAM_TESTS_CHECK_H
#define VRAM_TESTS_CHECK_H

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            printf("FAILED line %d: %s (%s)\n", __LINE__, #cond,             \
                   vram_last_error() ? vram_last_error() : "no error");      \
            return 1;                                                        \
        }                                                                    \
    } while (0)

#endif
