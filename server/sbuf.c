/* Growable byte strings; see sbuf.h. */
#include "server/sbuf.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"

int sbuf_append(char **p, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 64;
        while (nc < *len + n + 1) nc *= 2;
        char *np = realloc(*p, nc);
        if (!np) return SPECD_ENOMEM;
        *p = np;
        *cap = nc;
    }
    if (n) memcpy(*p + *len, s, n);
    *len += n;
    (*p)[*len] = 0;
    return 0;
}
