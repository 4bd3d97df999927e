/* libFuzzer target for the SSE writer: server/sse.h (the response channel) fed with events
 * built by api_chunk_json / api_usage_chunk_json / api_error_json and framed by
 * api_sse_event, exactly as server/loop.c does.
 *
 * The input is a program of byte-coded operations on one channel, interleaving writer
 * pushes (content chunks of arbitrary text, finish chunks, usage chunk, error event,
 * [DONE], raw close) with reader pulls of arbitrary sizes, park/wake via bound hooks,
 * re-binding, take_if_closed and detach. Text is made valid UTF-8 first (invalid bytes ->
 * '?'), which is what the streaming detokenizer guarantees the loop.
 * Invariants (abort() on violation):
 *   - bytes read == a prefix of bytes written, in order; all of them once closed and not
 *     detached; pull returns -1 only when closed and drained, 0 only when empty;
 *   - park is never called while parked, wake only while parked, never after detach;
 *   - push after close -> SPECD_ESTATE, after detach -> SPECD_ECANCELED;
 *   - the stream read back is a sequence of events "data: <payload>\n\n", no raw newline
 *     inside a payload, every payload a JSON object except "[DONE]", which comes exactly
 *     once and last when the writer finished normally; the content deltas concatenate to
 *     the text that was pushed; chunk ids / objects are consistent.
 * Build and run: scripts/fuzz.sh sse SECONDS. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "server/api.h"
#include "server/sse.h"

#define CHECK(c)                                                                      \
    do {                                                                              \
        if (!(c)) {                                                                   \
            fprintf(stderr, "fuzz_sse: invariant failed at %s:%d: %s\n", __FILE__,    \
                    __LINE__, #c);                                                    \
            abort();                                                                  \
        }                                                                             \
    } while (0)

typedef struct {
    char *p;
    size_t len, cap;
} buf;

static void buf_add(buf *b, const void *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->len + n + 1) c *= 2;
        b->p = realloc(b->p, c);
        CHECK(b->p);
        b->cap = c;
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

typedef struct {
    int parked, detached, parks, wakes;
} hooks;

static void on_park(void *arg) {
    hooks *h = arg;
    CHECK(!h->parked);
    CHECK(!h->detached);
    h->parked = 1;
    h->parks++;
}

static void on_wake(void *arg) {
    hooks *h = arg;
    CHECK(h->parked);
    CHECK(!h->detached);
    h->parked = 0;
    h->wakes++;
}

/* Replace bytes that are not part of a valid UTF-8 sequence (jansson's rules) with '?'. */
static size_t make_utf8(const uint8_t *in, size_t n, char *out) {
    size_t i = 0, o = 0;
    while (i < n) {
        uint8_t c = in[i];
        size_t need = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : 9;
        int ok = need != 9 && i + need < n;
        for (size_t k = 1; ok && k <= need; k++)
            if ((in[i + k] & 0xC0) != 0x80) ok = 0;
        if (ok && need) {
            uint32_t cp = c & (0x3F >> need);
            for (size_t k = 1; k <= need; k++) cp = (cp << 6) | (in[i + k] & 0x3F);
            if ((need == 1 && cp < 0x80) || (need == 2 && cp < 0x800) || (need == 3 && cp < 0x10000) ||
                cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
                ok = 0;
        }
        if (!ok) {
            out[o++] = '?';
            i++;
            continue;
        }
        if (c == 0) {  /* jansson strings may hold NUL through json_stringn; keep it */
            out[o++] = 0;
            i++;
            continue;
        }
        memcpy(out + o, in + i, need + 1);
        o += need + 1;
        i += need + 1;
    }
    return o;
}

typedef struct {
    const uint8_t *d;
    size_t n, at;
} reader;

static int next(reader *r) { return r->at < r->n ? r->d[r->at++] : -1; }

static int push_event(sse_chan *c, json_t *v, buf *sent, hooks *h, int closed) {
    CHECK(v);
    size_t len = 0;
    char *ev = api_sse_event(v, &len);
    json_decref(v);
    CHECK(ev);
    int rc = sse_chan_push(c, ev, len);
    if (h->detached) CHECK(rc == SPECD_ECANCELED);
    else if (closed) CHECK(rc == SPECD_ESTATE);
    else CHECK(rc == 0);
    if (!rc) buf_add(sent, ev, len);
    free(ev);
    return rc;
}

static void do_pull(sse_chan *c, size_t max, buf *got, const buf *sent, int closed, hooks *h) {
    char tmp[4096];
    if (max > sizeof tmp) max = sizeof tmp;
    if (!max) max = 1;
    size_t pending = sent->len - got->len;
    ssize_t n = sse_chan_pull(c, tmp, max);
    if (pending) {
        CHECK(n == (ssize_t)(pending < max ? pending : max));
        CHECK(!memcmp(tmp, sent->p + got->len, (size_t)n));
        buf_add(got, tmp, (size_t)n);
    } else if (closed) {
        CHECK(n == -1);
    } else {
        CHECK(n == 0);
        (void)h;
    }
}

/* Parse the read-back stream and check the framing. */
static void check_stream(const buf *got, api_kind kind, int done_sent, const buf *text_sent, int have_error) {
    size_t at = 0;
    int n_done = 0;
    buf text = {0};
    while (at < got->len) {
        const char *ev = got->p + at;
        size_t left = got->len - at;
        CHECK(left >= 8 && !memcmp(ev, "data: ", 6));
        const char *end = memchr(ev, '\n', left);
        CHECK(end && (size_t)(end - ev) + 1 < left && end[1] == '\n');
        size_t plen = (size_t)(end - ev) - 6;
        const char *pl = ev + 6;
        CHECK(!memchr(pl, '\r', plen));
        CHECK(!n_done);  /* nothing after [DONE] */
        if (plen == 6 && !memcmp(pl, "[DONE]", 6)) {
            n_done++;
        } else {
            json_error_t je;
            json_t *v = json_loadb(pl, plen, JSON_ALLOW_NUL, &je);
            CHECK(json_is_object(v));
            if (json_object_get(v, "error")) {
                CHECK(have_error);
            } else {
                const char *obj = json_string_value(json_object_get(v, "object"));
                CHECK(obj && !strcmp(obj, kind == API_CHAT ? "chat.completion.chunk" : "text_completion"));
                CHECK(!strcmp(json_string_value(json_object_get(v, "id")), "chatcmpl-fuzz"));
                json_t *ch = json_array_get(json_object_get(v, "choices"), 0);
                if (ch) {
                    json_t *t = kind == API_CHAT ? json_object_get(json_object_get(ch, "delta"), "content")
                                                 : json_object_get(ch, "text");
                    if (json_is_string(t)) buf_add(&text, json_string_value(t), json_string_length(t));
                } else {
                    CHECK(json_is_object(json_object_get(v, "usage")));
                }
            }
            json_decref(v);
        }
        at += (size_t)(end - ev) + 2;
    }
    if (done_sent) CHECK(n_done == 1);
    if (done_sent) CHECK(text.len == text_sent->len && (!text.len || !memcmp(text.p, text_sent->p, text.len)));
    free(text.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    reader in = {data, size, 0};
    int flags = next(&in);
    api_kind kind = flags & 1 ? API_CHAT : API_COMPLETION;
    int include_usage = (flags >> 1) & 1;
    int nonstream = (flags >> 2) & 1;  /* read with take_if_closed at the end */

    sse_chan *c = sse_chan_new();
    CHECK(c);
    sse_chan_ref(c);  /* the loop's and the connection's references */
    hooks h = {0};
    sse_chan_bind(c, on_park, on_wake, &h);
    buf sent = {0}, got = {0}, text = {0};
    int closed = 0, done_sent = 0, have_error = 0, first = 1;
    char *tmp = malloc(size * 4 + 16);
    CHECK(tmp);

    for (int op; (op = next(&in)) >= 0;) {
        switch (op % 10) {
        case 0: case 1: case 2: {  /* content chunk of arbitrary text */
            int n = next(&in);
            if (n < 0) n = 0;
            size_t avail = in.n - in.at, take = (size_t)n < avail ? (size_t)n : avail;
            size_t tl = make_utf8(in.d + in.at, take, tmp);
            in.at += take;
            if (!push_event(c, api_chunk_json(kind, "chatcmpl-fuzz", 1, "m", 0, first, tmp, tl, NULL, NULL,
                                              include_usage), &sent, &h, closed))
                buf_add(&text, tmp, tl);
            first = 0;
            break;
        }
        case 3:  /* finish chunk */
            push_event(c, api_chunk_json(kind, "chatcmpl-fuzz", 1, "m", 0, 0, NULL, 0, (op & 16) ? "stop" : "length",
                                         NULL, include_usage), &sent, &h, closed);
            break;
        case 4: case 5: {  /* reader pulls up to max bytes */
            int m = next(&in);
            do_pull(c, m < 0 ? 1 : (size_t)m * ((op & 32) ? 16 : 1), &got, &sent, closed, &h);
            break;
        }
        case 6: {  /* writer ends: usage chunk (maybe), [DONE], close */
            api_usage u = {3, 5, op & 16 ? 1 : 0, 4, 3, 2, NULL, 0};
            if (include_usage) push_event(c, api_usage_chunk_json(kind, "chatcmpl-fuzz", 1, "m", &u), &sent, &h, closed);
            int rc = sse_chan_push(c, API_SSE_DONE, strlen(API_SSE_DONE));
            if (!rc) { buf_add(&sent, API_SSE_DONE, strlen(API_SSE_DONE)); done_sent = 1; }
            else CHECK(closed || h.detached);
            sse_chan_close(c, 200);
            closed = 1;
            break;
        }
        case 7: {  /* error path: error event + [DONE] + close (send_error_body) */
            api_error e;
            api_fail(&e, 400 + op % 100, NULL, NULL, NULL, "error %d", op);
            if (!push_event(c, api_error_json(&e), &sent, &h, closed)) have_error = 1;
            int rc = sse_chan_push(c, API_SSE_DONE, strlen(API_SSE_DONE));
            if (!rc) { buf_add(&sent, API_SSE_DONE, strlen(API_SSE_DONE)); done_sent = 1; }
            sse_chan_close(c, 200);
            sse_chan_close(c, 500);  /* idempotent */
            closed = 1;
            break;
        }
        case 8:  /* re-bind (before any park is allowed by the contract) or detach */
            if (op & 16) {
                sse_chan_detach(c);
                h.detached = 1;
                h.parked = 0;
                CHECK(sse_chan_detached(c));
                CHECK(sse_chan_push(c, "x", 1) == SPECD_ECANCELED);
            } else if (!h.parked) {
                sse_chan_bind(c, on_park, on_wake, &h);
            }
            break;
        case 9:
            CHECK(sse_chan_closed(c) == closed);
            break;
        }
        if (h.detached) break;
    }
    if (!closed) {  /* the loop always finishes a job */
        api_usage u = {1, 1, 0, 0, 0, 0, NULL, 0};
        if (include_usage) push_event(c, api_usage_chunk_json(kind, "chatcmpl-fuzz", 1, "m", &u), &sent, &h, closed);
        int rc = sse_chan_push(c, API_SSE_DONE, strlen(API_SSE_DONE));
        if (!rc) { buf_add(&sent, API_SSE_DONE, strlen(API_SSE_DONE)); done_sent = 1; }
        sse_chan_close(c, 200);
        closed = 1;
    }
    CHECK(sse_chan_closed(c));
    if (!h.detached) {
        if (nonstream) {
            char *all = NULL;
            size_t len = 0;
            int status = 0;
            CHECK(sse_chan_take_if_closed(c, &all, &len, &status) == 1);
            CHECK(status == 200);
            CHECK(len == sent.len - got.len);
            if (len) CHECK(!memcmp(all, sent.p + got.len, len));
            if (len) buf_add(&got, all, len);
            free(all);
            char one;
            CHECK(sse_chan_pull(c, &one, 1) == -1);
        } else {
            for (int guard = 0;; guard++) {
                CHECK(guard < 1 << 22);
                size_t before = got.len;
                if (before == sent.len) {
                    char one;
                    CHECK(sse_chan_pull(c, &one, 1) == -1);
                    break;
                }
                do_pull(c, 1 + (before * 7) % 977, &got, &sent, closed, &h);
            }
        }
        CHECK(got.len == sent.len && (!got.len || !memcmp(got.p, sent.p, got.len)));
        check_stream(&got, kind, done_sent, &text, have_error);
    } else {
        CHECK(got.len <= sent.len);
    }
    CHECK(h.wakes <= h.parks);
    sse_chan_unref(c);
    sse_chan_unref(c);
    free(tmp);
    free(sent.p);
    free(got.p);
    free(text.p);
    return 0;
}
