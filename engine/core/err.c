/* The one table of error codes and their messages (see err.h). */
#include "engine/core/err.h"

#include <stdarg.h>
#include <stdio.h>

const char *specd_strerror(int code) {
    switch (code) {
    case SPECD_OK: return "ok";
    case SPECD_ENOMEM: return "out of memory";
    case SPECD_EIO: return "I/O error";
    case SPECD_EFORMAT: return "malformed input";
    case SPECD_EUNSUPPORTED: return "unsupported";
    case SPECD_EINVAL: return "invalid argument";
    case SPECD_ERANGE: return "out of range";
    case SPECD_ENOSPACE: return "no space left";
    case SPECD_ENOTFOUND: return "not found";
    case SPECD_ECUDA: return "CUDA error";
    case SPECD_ESTATE: return "invalid state";
    case SPECD_ETEMPLATE: return "template error";
    case SPECD_EUTF8: return "invalid UTF-8";
    case SPECD_ECANCELED: return "cancelled";
    case SPECD_ETIMEOUT: return "timed out";
    default: return "unknown error";
    }
}

int specd_errf(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}
