/* Server logging: see log.h. Text lines look like
 *   2025-01-01T12:00:00.123Z INFO  message
 * and JSON lines like {"ts":"...","level":"info","msg":"..."}; request lines add fields. */
#include "server/log.h"

#include <jansson.h>
#include <utf8proc.h>
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

/* Bytes of a valid UTF-8 sequence at s, 0 if none (utf8proc rejects overlong forms and
 * surrogates). */
static size_t utf8_len(const unsigned char *s) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate(s, -1, &cp);
    return n > 0 ? (size_t)n : 0;
}

size_t log_escape(const char *in, char *out, size_t cap) {
    size_t o = 0;
    if (!cap) return 0;
    for (const unsigned char *s = (const unsigned char *)in; *s && o + 5 < cap;) {
        size_t n = *s >= 0x80 ? utf8_len(s) : 1;
        if (n > 1) {                       /* valid multi-byte character: as is */
            memcpy(out + o, s, n);
            o += n;
            s += n;
        } else if (*s < 0x20 || *s == 0x7f || *s >= 0x80 || *s == '\\') {
            o += (size_t)snprintf(out + o, cap - o, *s == '\\' ? "\\\\" : "\\x%02x", *s);
            s++;
        } else {
            out[o++] = (char)*s++;
        }
    }
    out[o] = 0;
    return o;
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
    char raw[2048];
    vsnprintf(raw, sizeof raw, fmt, ap);
    size_t len = strlen(raw);
    while (len && raw[len - 1] == '\n') raw[--len] = 0;   /* MHD's messages end in a newline */
    log_escape(raw, msg, sizeof msg);   /* one line whatever the message held */
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
    char ts[40], method[64], path[256];
    timestamp(ts, sizeof ts);
    /* client-chosen text: escaped, so it can neither start a line nor break the JSON */
    log_escape(r->method ? r->method : "-", method, sizeof method);
    log_escape(r->path ? r->path : "-", path, sizeof path);
    if (g_json) {
        json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:f, s:s?}",
                              "ts", ts, "level", "info", "msg", "request", "id",
                              r->id ? r->id : "-", "method", method,
                              "path", path, "status", r->status,
                              "prompt_tokens", r->prompt_tokens, "output_tokens",
                              r->output_tokens, "total_s", r->total, "finish", r->finish);
        if (o && r->ttft >= 0) json_object_set_new(o, "ttft_s", json_real(r->ttft));
        if (o && r->request_id) json_object_set_new(o, "request_id", json_string(r->request_id));
        if (o) emit_json(o);
        return;
    }
    char line[1024], ttft[32];
    if (r->ttft >= 0) snprintf(ttft, sizeof ttft, "%.3fs", r->ttft);
    else snprintf(ttft, sizeof ttft, "-");
    int n = snprintf(line, sizeof line,
                     "%s info  %s %s %s %d prompt=%d output=%d ttft=%s total=%.3fs finish=%s rid=%s\n",
                     ts, r->id ? r->id : "-", method, path, r->status, r->prompt_tokens, r->output_tokens,
                     ttft, r->total, r->finish ? r->finish : "-", r->request_id ? r->request_id : "-");
    if (n >= (int)sizeof line) n = sizeof line - 1, line[n - 1] = '\n';
    fwrite(line, 1, (size_t)n, stderr);
}
