/* ffn_neon.c: placeholder, filled below. */
#if defined(__aarch64__)
#include "ffn_internal.h"
#endif
typedef int coli_ffn_neon_unused;
