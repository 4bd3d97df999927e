/* A growable byte string, always NUL-terminated (prefix sbuf_): the one append the server's
 * buffers share (request bodies, streamed text, parser state of tool calls and reasoning). */
#ifndef SPECD_SBUF_H
#define SPECD_SBUF_H

#include <stddef.h>

typedef struct {
    char *p;
    size_t len, cap;
} sbuf;

/* Append n bytes of s (s may be NULL when n is 0) to the string *p of *len bytes in a
 * buffer of *cap, doubling it as needed; *p stays NUL-terminated. 0, or SPECD_ENOMEM with
 * the string unchanged. */
int sbuf_append(char **p, size_t *len, size_t *cap, const char *s, size_t n);

static inline int sbuf_add(sbuf *b, const char *s, size_t n) { return sbuf_append(&b->p, &b->len, &b->cap, s, n); }

#endif
