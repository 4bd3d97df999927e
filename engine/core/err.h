/* specd error codes: one table for the whole project.
 *
 * Functions return int: 0 on success, a negative SPECD_E* code on failure. Where the
 * caller needs more than the code, the function also takes (char *err, size_t errlen)
 * and writes a one-line message naming the file / field / knob at fault. */
#ifndef SPECD_ERR_H
#define SPECD_ERR_H

#include <stddef.h>

enum {
    SPECD_OK = 0,
    SPECD_ENOMEM = -1,      /* allocation failed */
    SPECD_EIO = -2,         /* open/read/mmap failed */
    SPECD_EFORMAT = -3,     /* malformed or truncated file */
    SPECD_EUNSUPPORTED = -4,/* valid input we do not support (arch, dtype, feature) */
    SPECD_EINVAL = -5,      /* bad argument or request field */
    SPECD_ERANGE = -6,      /* value out of range (too long prompt, too many tokens) */
    SPECD_ENOSPACE = -7,    /* out of KV blocks / slots / queue room */
    SPECD_ENOTFOUND = -8,   /* missing tensor, key, model, request */
    SPECD_ECUDA = -9,       /* CUDA / cuBLAS / NCCL failure */
    SPECD_ESTATE = -10,     /* call not valid in the current state */
    SPECD_ETEMPLATE = -11,  /* chat template raised or failed to render */
    SPECD_EUTF8 = -12,      /* invalid UTF-8 */
    SPECD_ECANCELED = -13,  /* request cancelled */
    SPECD_ETIMEOUT = -14,   /* timed out */
};

/* Static string for a code; never NULL. */
const char *specd_strerror(int code);

/* snprintf into err (if non-NULL) and return code: `return specd_errf(err, n, SPECD_EIO,
 * "%s: %s", path, strerror(errno));` */
int specd_errf(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
