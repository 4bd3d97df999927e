/* Server logging (prefix log_): leveled lines on stderr, plain text or JSON lines.
 *
 * The level and format are process-wide settings chosen once at start-up (by cmd_serve)
 * before any thread logs; they are not per-request state. Each call writes one whole
 * line with a single fwrite so lines from MHD threads and the loop never interleave. */
#ifndef SPECD_LOG_H
#define SPECD_LOG_H

#include <stddef.h>

typedef enum { LOG_DEBUG = 0, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_OFF } log_level;

/* "debug", "info", "warn"/"warning", "error", "off" -> level; -1 if unknown. */
int log_level_parse(const char *s);
const char *log_level_name(log_level l);

void log_configure(log_level level, int json);
int log_enabled(log_level level);

/* printf-style message at a level. */
void log_msg(log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#include <stdarg.h>
void log_vmsg(log_level level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

/* The one line per finished request. Times in seconds; ttft < 0 when no token came. */
typedef struct {
    const char *id;          /* "cmpl-..." */
    const char *method, *path;
    int status;
    int prompt_tokens, output_tokens;
    double ttft, total;
    const char *finish;      /* "stop", "length", "abort", "error", NULL */
    const char *request_id;  /* X-Request-Id (NULL: none) */
} log_request_line;

void log_request(const log_request_line *r);

/* Copy in to out (cap bytes, NUL-terminated, cut at a whole escape) with control bytes,
 * backslashes and bytes that are not valid UTF-8 written as \xNN / \\: the result is
 * one line of valid UTF-8. Returns its length. */
size_t log_escape(const char *in, char *out, size_t cap);

#endif
