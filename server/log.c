/* Server logging: see log.h. Text lines look like
 *   2025-01-01T12:00:00.123Z INFO  message
 * and JSON lines like {"ts":"...","level":"info","msg":"..."}; request lines add fields. */
#include "server/log.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>

/* Written once before threads start, read afterwards: see log.h. */
static log_level g_level = LOG_INFO;
static int g_json = 0;

int log_level_parse(const char *s) {
    if (!s) return -1;
    if (!strcasecmp(s, "debug")) return LOG_DEBUG;
    if (!strcasecmp(s, "info")) return LOG_INFO;
    if (!strcasecmp(s, "warn") || !strcasecmp(s, "warning")) return LOG_WARN;
    if (!strcasecmp(s, "error")) return LOG_ERROR;
    if (!strcasecmp(s, "off")) return LOG_OFF;
    return -1;
}

const char *log_level_name(log_level l) {
    switch (l) {
    case LOG_DEBUG: return "debug";
    case LOG_INFO: return "info";
    case LOG_WARN: return "warn";
    case LOG_ERROR: return "error";
    default: return "off";
    }
}

void log_configure(log_level level, int json) {
    g_level = level;
    g_json = json;
}

int log_enabled(log_level level) { return level >= g_level && level < LOG_OFF; }

static void timestamp(char *buf, size_t cap) {
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03dZ", (int)(tv.tv_usec / 1000));
}

static void emit_json(json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    if (s) {
        size_t n = strlen(s);
        s[n] = '\n';  /* reuse the NUL slot so the line goes out in one write */
        fwrite(s, 1, n + 1, stderr);
        free(s);
    }
    json_decref(o);
}

void log_msg(log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vmsg(level, fmt, ap);
    va_end(ap);
}

void log_vmsg(log_level level, const char *fmt, va_list ap) {
    if (!log_enabled(level)) return;
    char msg[2048], ts[40];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t len = strlen(msg);
    while (len && msg[len - 1] == '\n') msg[--len] = 0;   /* MHD's messages end in a newline */
    timestamp(ts, sizeof ts);
    if (g_json) {
        emit_json(json_pack("{s:s, s:s, s:s}", "ts", ts, "level", log_level_name(level),
                            "msg", msg));
        return;
    }
    char line[2200];
    int n = snprintf(line, sizeof line, "%s %-5s %s\n", ts, log_level_name(level), msg);
    if (n >= (int)sizeof line) n = sizeof line - 1, line[n - 1] = '\n';
    fwrite(line, 1, (size_t)n, stderr);
}

void log_request(const log_request_line *r) {
    if (!log_enabled(LOG_INFO)) return;
    char ts[40];
    timestamp(ts, sizeof ts);
    if (g_json) {
        json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:f, s:s?}",
                              "ts", ts, "level", "info", "msg", "request", "id",
                              r->id ? r->id : "-", "method", r->method ? r->method : "-",
                              "path", r->path ? r->path : "-", "status", r->status,
                              "prompt_tokens", r->prompt_tokens, "output_tokens",
                              r->output_tokens, "total_s", r->total, "finish", r->finish);
        if (o && r->ttft >= 0) json_object_set_new(o, "ttft_s", json_real(r->ttft));
        if (o) emit_json(o);
        return;
    }
    char line[1024], ttft[32];
    if (r->ttft >= 0) snprintf(ttft, sizeof ttft, "%.3fs", r->ttft);
    else snprintf(ttft, sizeof ttft, "-");
    int n = snprintf(line, sizeof line,
                     "%s info  %s %s %s %d prompt=%d output=%d ttft=%s total=%.3fs finish=%s\n",
                     ts, r->id ? r->id : "-", r->method ? r->method : "-",
                     r->path ? r->path : "-", r->status, r->prompt_tokens, r->output_tokens,
                     ttft, r->total, r->finish ? r->finish : "-");
    if (n >= (int)sizeof line) n = sizeof line - 1, line[n - 1] = '\n';
    fwrite(line, 1, (size_t)n, stderr);
}
