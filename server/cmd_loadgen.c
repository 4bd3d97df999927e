/* specd loadgen: a streaming load generator for OpenAI-compatible servers, in C (issue #14
 * point 5), for levels where a Python client is the limit: scripts/bench.py's report
 * (requests/s, output tokens/s, TTFT, ITL and TPOT percentiles, specd's host cost per
 * output token) from a few threads, each one libuv loop driving its share of the streams.
 *
 * Each stream is one keep-alive HTTP/1.1 connection that sends its next request when the
 * previous response has ended (closed loop), or, with --request-rate, takes the arrivals of
 * a Poisson schedule as it is free (open loop: at most `concurrency` in flight, the rest
 * wait in the client, their wait reported apart). A response is parsed as it arrives: status line, headers,
 * then the body (chunked or of a Content-Length) as server-sent events; an event that
 * brings a token (brings_token: as scripts/bench.py counts them) is a token arrival (TTFT
 * from the request's send, ITL between arrivals), the usage event gives the
 * output token count ("completion_tokens"), "[DONE]" or the body's end closes it. Events
 * are scanned for those keys, not parsed as JSON: the client must cost far less than the
 * server it measures (its own ceiling: run a level with --threads N and 2N; when the
 * figure does not move, the server is the limit).
 *
 * Prompts are seeded per request and level: random token ids for completions (--prompt-kind
 * tokens, default) or words from a fixed list (chat, or completions with --prompt-kind
 * words). No two levels of a run share a prompt, so a level does not find the one before
 * it in the server's prefix cache; runs to compare with each other want different --seed
 * values for the same reason. */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "server/cli.h"
#include "server/cmd.h"

typedef struct {
    char host[256];
    int port;
    int chat, words;
    int in_len, out_len, threads, ignore_eos;
    double rate;     /* --request-rate: Poisson arrivals per second, 0: closed loop */
    int tok_lo, tok_hi;
    uint64_t seed;
    uint64_t salt;   /* the level's: its prompts differ from every other level's */
    char model[256];
    char api_key[256];
} lg_opts;

typedef struct {   /* one finished request */
    int ok, tokens;
    double ttft, e2e, tpot;
    double arrive, wait;   /* --request-rate: its arrival, and the time it waited for a stream */
} lg_result;

typedef struct {   /* a growable array of doubles */
    double *v;
    size_t n, cap;
} dvec;

static int dvec_push(dvec *d, double x) {
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 1024;
        double *v = realloc(d->v, cap * sizeof *v);
        if (!v) return -1;
        d->v = v, d->cap = cap;
    }
    d->v[d->n++] = x;
    return 0;
}

struct lg_worker;

enum { ST_STATUS, ST_HEADERS, ST_CHUNK_SIZE, ST_CHUNK_DATA, ST_CHUNK_END, ST_BODY, ST_TRAILER };

typedef struct {
    uv_tcp_t tcp;
    uv_connect_t creq;
    uv_write_t wreq;
    struct lg_worker *w;
    char *req;              /* the request being sent */
    size_t req_len;
    int idx;                /* its index, -1 between requests */
    /* response parsing */
    char *in;               /* bytes received not yet consumed */
    size_t in_len, in_cap;
    int state, status, chunked, close_after;
    long left;              /* of the current chunk or Content-Length body */
    char *ev;               /* the current server-sent event's bytes */
    size_t ev_len, ev_cap;
    double t0, t_first, t_last;
    int n_text, usage_tokens, done, error;
    int open;
} lg_conn;

typedef struct lg_worker {
    uv_loop_t loop;
    const lg_opts *o;
    atomic_int *next;       /* shared: the next request index */
    int n_req;              /* requests in the level */
    lg_conn *conns;
    int n_conns;
    struct sockaddr_storage addr;
    lg_result *res;         /* indexed by request */
    dvec gaps;              /* ITL of every request of this worker, seconds */
    char first_error[256];
    /* --request-rate (open loop): this worker's share of the rate, the next arrival's time,
     * the arrivals waiting for a free stream (request indices, FIFO) */
    double rate, next_t;
    uint64_t rng;
    uv_timer_t timer;
    int *queue, q_head, q_tail, arrivals_done;
} lg_worker;

static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static const char *const WORDS[] = {"the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "by",
                                    "with", "as", "at", "from", "his", "an", "were", "are", "which", "this",
                                    "be", "have", "or", "had", "not", "but", "first", "one", "their", "its",
                                    "new", "after", "who", "they", "two", "her", "she", "been", "other",
                                    "when", "there", "all", "during", "into", "school", "time", "may"};

/* Request idx's HTTP bytes (malloc'd, *len set). */
static char *build_request(const lg_opts *o, int idx, size_t *len) {
    uint64_t s = mix(o->seed ^ mix(o->salt ^ mix((uint64_t)idx + 1)));
    size_t cap = 1024 + (size_t)o->in_len * 12, n = 0;
    char *body = malloc(cap), *req = NULL;
    if (!body) return NULL;
#define PUT(...) (n += (size_t)snprintf(body + n, cap - n, __VA_ARGS__))
    PUT("{\"model\":\"%s\",\"max_tokens\":%d,\"stream\":true,\"temperature\":0,"
        "\"stream_options\":{\"include_usage\":true}%s,",
        o->model, o->out_len, o->ignore_eos ? ",\"ignore_eos\":true" : "");
    if (o->chat) PUT("\"messages\":[{\"role\":\"user\",\"content\":\"");
    else PUT(o->words ? "\"prompt\":\"" : "\"prompt\":[");
    for (int i = 0; i < o->in_len; i++) {
        s = mix(s);
        if (o->chat || o->words) PUT("%s%s", i ? " " : "", WORDS[s % (sizeof WORDS / sizeof WORDS[0])]);
        else PUT("%s%d", i ? "," : "", o->tok_lo + (int)(s % (uint64_t)(o->tok_hi - o->tok_lo + 1)));
    }
    if (o->chat) PUT("\"}]}");
    else PUT(o->words ? "\"}" : "]}");
#undef PUT
    size_t rcap = n + 256 + strlen(o->host) + strlen(o->api_key);   /* the headers' fixed text is < 200 bytes */
    if ((req = malloc(rcap))) {
        int h = snprintf(req, rcap,
                         "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                         "Accept: text/event-stream\r\n%s%s%sContent-Length: %zu\r\n\r\n",
                         o->chat ? "/v1/chat/completions" : "/v1/completions", o->host, o->port,
                         o->api_key[0] ? "Authorization: Bearer " : "", o->api_key,
                         o->api_key[0] ? "\r\n" : "", n);
        if (h < 0 || (size_t)h + n >= rcap) {
            free(req);
            req = NULL;
        } else {
            memcpy(req + h, body, n);
            *len = (size_t)h + n;
        }
    }
    free(body);
    return req;
}

static int grow(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 4096;
    while (c < need) c *= 2;
    char *b = realloc(*buf, c);
    if (!b) return -1;
    *buf = b, *cap = c;
    return 0;
}

/* The value after the first `key` in [p, e): -1 absent or not a string, 0 "", 1 a
 * non-empty string. */
static int str_val(const char *p, const char *e, const char *key) {
    const char *q = memmem(p, (size_t)(e - p), key, strlen(key));
    if (!q) return -1;
    const char *v = q + strlen(key);
    while (v < e && (*v == ' ' || *v == ':')) v++;
    if (v >= e || *v != '"') return -1;
    return v + 1 < e && v[1] != '"';
}

/* An event that brings a token (as scripts/bench.py counts them): a choice with its text
 * (completions) or delta content (chat), not null, unless it is the empty text of the
 * finish chunk or chat's role chunk. */
static int brings_token(const char *p, const char *e, int chat) {
    const int t = str_val(p, e, chat ? "\"content\"" : "\"text\"");
    if (t < 0) return 0;
    if (t == 1) return 1;
    const char *f = memmem(p, (size_t)(e - p), "\"finish_reason\"", 15);
    if (f) {
        f += 15;
        while (f < e && (*f == ' ' || *f == ':')) f++;
        if (f < e && *f != 'n') return 0;   /* finishing, no text */
    }
    return !(chat && memmem(p, (size_t)(e - p), "\"role\"", 6));
}

/* One server-sent event (its bytes without the blank line). */
static void on_event(lg_conn *c, const char *p, size_t n) {
    const char *e = p + n;
    if (n < 5 || memcmp(p, "data:", 5)) return;   /* comments, other fields */
    p += 5 + (n > 5 && p[5] == ' ');
    if (e - p >= 6 && !memcmp(p, "[DONE]", 6)) {
        c->done = 1;
        return;
    }
    if (memmem(p, (size_t)(e - p), "\"error\"", 7) && !memmem(p, (size_t)(e - p), "\"choices\"", 9)) {
        c->error = 1;
        return;
    }
    const char *u = memmem(p, (size_t)(e - p), "\"completion_tokens\"", 19);
    if (u) c->usage_tokens = atoi(u + 20 + (u[19] == ' '));
    if (brings_token(p, e, c->w->o->chat)) {
        const double t = cli_now_s();
        if (c->n_text++ == 0) c->t_first = t;
        else dvec_push(&c->w->gaps, t - c->t_last);
        c->t_last = t;
    }
}

/* Body bytes: events end at a blank line; carriage returns are dropped, so servers that
 * end lines with CRLF parse as those that use LF. */
static void on_body(lg_conn *c, const char *p, size_t n) {
    if (grow(&c->ev, &c->ev_cap, c->ev_len + n + 1)) {
        c->error = 1;
        return;
    }
    for (size_t i = 0; i < n; i++)
        if (p[i] != '\r') c->ev[c->ev_len++] = p[i];
    size_t start = 0;
    for (size_t i = 0; i + 1 < c->ev_len; i++)
        if (c->ev[i] == '\n' && c->ev[i + 1] == '\n') {
            on_event(c, c->ev + start, i - start);
            start = i + 2;
            i++;
        }
    memmove(c->ev, c->ev + start, c->ev_len - start);
    c->ev_len -= start;
}

static void start_next(lg_conn *c);
static void conn_close(lg_conn *c);

static void finish(lg_conn *c) {
    lg_worker *w = c->w;
    const double end = cli_now_s();
    lg_result *r = &w->res[c->idx];
    r->ok = c->status == 200 && !c->error && (c->n_text > 0 || c->usage_tokens > 0);
    r->tokens = c->usage_tokens > 0 ? c->usage_tokens : c->n_text;
    r->ttft = c->n_text ? c->t_first - c->t0 : -1;
    r->e2e = end - c->t0;
    r->tpot = r->tokens > 1 && c->n_text ? (end - c->t_first) / (r->tokens - 1) : -1;
    if (!r->ok && !w->first_error[0])
        snprintf(w->first_error, sizeof w->first_error, "request %d: HTTP %d%s", c->idx, c->status,
                 c->error ? ", error event or cut short" : "");
    c->idx = -1;
    if (c->close_after) conn_close(c);
    else start_next(c);
}

/* Consume what can be parsed of c->in; a response that ends is finished after (the next
 * request on the connection starts from an empty buffer). */
static void parse(lg_conn *c) {
    size_t off = 0;
    int fin = 0;
    while (!fin && c->idx >= 0 && off < c->in_len) {
        char *p = c->in + off, *e = c->in + c->in_len;
        if (c->state == ST_CHUNK_DATA || c->state == ST_BODY) {
            size_t take = (size_t)(e - p) < (size_t)c->left ? (size_t)(e - p) : (size_t)c->left;
            on_body(c, p, take);
            off += take;
            c->left -= (long)take;
            if (c->left == 0) {
                if (c->state == ST_BODY) {
                    fin = 1;
                    break;
                }
                c->state = ST_CHUNK_END;
            }
            continue;
        }
        char *nl = memchr(p, '\n', (size_t)(e - p));
        if (!nl) break;
        size_t ll = (size_t)(nl - p);
        if (ll && p[ll - 1] == '\r') ll--;
        off += (size_t)(nl - p) + 1;
        if (c->state == ST_STATUS) {
            c->status = ll > 12 ? atoi(p + 9) : 0;
            c->state = ST_HEADERS;
        } else if (c->state == ST_HEADERS) {
            if (ll == 0) {
                if (c->chunked) c->state = ST_CHUNK_SIZE;
                else if (c->left > 0) c->state = ST_BODY;
                else {   /* no body */
                    fin = 1;
                    break;
                }
            } else if (ll > 18 && !strncasecmp(p, "transfer-encoding:", 18) && memmem(p, ll, "chunked", 7)) {
                c->chunked = 1;
            } else if (ll > 15 && !strncasecmp(p, "content-length:", 15)) {
                c->left = atol(p + 15);
            } else if (ll > 11 && !strncasecmp(p, "connection:", 11) && memmem(p, ll, "close", 5)) {
                c->close_after = 1;
            }
        } else if (c->state == ST_CHUNK_SIZE) {
            c->left = strtol(p, NULL, 16);
            c->state = c->left > 0 ? ST_CHUNK_DATA : ST_TRAILER;
        } else if (c->state == ST_CHUNK_END) {
            c->state = ST_CHUNK_SIZE;
        } else if (c->state == ST_TRAILER && ll == 0) {
            fin = 1;
        }
    }
    memmove(c->in, c->in + off, c->in_len - off);
    c->in_len -= off;
    if (fin) finish(c);
}

static void on_alloc(uv_handle_t *h, size_t sug, uv_buf_t *b) {
    lg_conn *c = h->data;
    (void)sug;
    if (grow(&c->in, &c->in_cap, c->in_len + 65536)) {
        *b = uv_buf_init(NULL, 0);
        return;
    }
    *b = uv_buf_init(c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
    lg_conn *c = s->data;
    (void)b;
    if (n < 0) {   /* EOF or error: a request in progress fails, the stream reconnects */
        if (c->idx >= 0) {   /* the response was cut short unless its [DONE] came */
            if (!c->done) c->error = 1;
            c->close_after = 1;
            finish(c);
        } else {
            conn_close(c);
        }
        return;
    }
    c->in_len += (size_t)n;
    parse(c);
}

static void on_written(uv_write_t *wr, int status) {
    lg_conn *c = wr->data;
    if (status < 0 && c->idx >= 0) {
        c->error = 1;
        c->close_after = 1;
        finish(c);
    }
}

static void send_request(lg_conn *c) {
    c->state = ST_STATUS;
    c->status = c->chunked = c->close_after = 0;
    c->left = 0;
    c->in_len = c->ev_len = 0;
    c->n_text = c->usage_tokens = c->done = c->error = 0;
    c->t0 = cli_now_s();
    uv_buf_t b = uv_buf_init(c->req, (unsigned)c->req_len);
    c->wreq.data = c;
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, on_written)) {
        c->error = 1;
        c->close_after = 1;
        finish(c);
    }
}

static void on_connect(uv_connect_t *cr, int status) {
    lg_conn *c = cr->data;
    if (status < 0) {
        lg_result *r = &c->w->res[c->idx];
        r->ok = 0;
        if (!c->w->first_error[0])
            snprintf(c->w->first_error, sizeof c->w->first_error, "connect: %s", uv_strerror(status));
        c->idx = -1;
        conn_close(c);
        return;
    }
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    send_request(c);
}

/* Take the next request index (shared by the workers); -1 when the level is done. */
static int take(lg_worker *w) {
    int i = atomic_fetch_add(w->next, 1);
    return i < w->n_req ? i : -1;
}

/* The next request for a stream that is free: the shared counter's (closed loop), or the
 * oldest arrival waiting (open loop); -1 if none now. */
static int next_index(lg_worker *w) {
    if (w->rate <= 0) return take(w);
    return w->q_head < w->q_tail ? w->queue[w->q_head++] : -1;
}

static void start_next(lg_conn *c) {
    lg_worker *w = c->w;
    const int i = next_index(w);
    if (i < 0) {   /* done, or (open loop) idle until the next arrival */
        if (w->rate <= 0 || w->arrivals_done) conn_close(c);
        return;
    }
    if (w->rate > 0) w->res[i].wait = cli_now_s() - w->res[i].arrive;
    free(c->req);
    c->idx = i;
    if (!(c->req = build_request(c->w->o, i, &c->req_len))) {
        c->w->res[i].ok = 0;
        c->idx = -1;
        conn_close(c);
        return;
    }
    if (c->open) {
        send_request(c);
        return;
    }
    uv_tcp_init(&c->w->loop, &c->tcp);
    c->tcp.data = c;
    uv_tcp_nodelay(&c->tcp, 1);
    c->open = 1;
    c->creq.data = c;
    if (uv_tcp_connect(&c->creq, &c->tcp, (const struct sockaddr *)&c->w->addr, on_connect)) on_connect(&c->creq, -1);
}

static void on_closed(uv_handle_t *h) {
    lg_conn *c = h->data;
    c->open = 0;
    if (c->idx < 0) start_next(c);   /* reconnect for the next request, if any */
}

static void conn_close(lg_conn *c) {
    if (c->open && !uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_closed);
}

/* Open loop: every arrival due by now joins the queue and goes to a free stream (one not
 * busy or closing; a closed one reconnects); then the timer waits for the next. Arrivals are
 * kept on an absolute schedule (exponential gaps at this worker's rate), so gaps under the
 * timer's millisecond are not lost. When the requests run out, free streams close. */
static void on_arrival(uv_timer_t *t) {
    lg_worker *w = t->data;
    const double now = cli_now_s();
    while (!w->arrivals_done && w->next_t <= now) {
        const int i = take(w);
        if (i < 0) {
            w->arrivals_done = 1;
            break;
        }
        w->res[i].arrive = w->next_t;
        w->queue[w->q_tail++] = i;
        w->rng = mix(w->rng);
        w->next_t += -log(((double)(w->rng >> 11) + 0.5) / 9007199254740992.0) / w->rate;
    }
    for (int k = 0; k < w->n_conns && w->q_head < w->q_tail; k++) {
        lg_conn *c = &w->conns[k];
        if (c->idx < 0 && !(c->open && uv_is_closing((uv_handle_t *)&c->tcp))) start_next(c);
    }
    if (w->arrivals_done) {
        for (int k = 0; k < w->n_conns; k++)
            if (w->conns[k].idx < 0) conn_close(&w->conns[k]);
        uv_close((uv_handle_t *)&w->timer, NULL);
        return;
    }
    const double ms = (w->next_t - cli_now_s()) * 1e3;
    uv_timer_start(&w->timer, on_arrival, ms > 0 ? (uint64_t)ms : 0, 0);
}

static void worker_main(void *arg) {
    lg_worker *w = arg;
    for (int i = 0; i < w->n_conns; i++) {
        lg_conn *c = &w->conns[i];
        c->w = w;
        c->idx = -1;
        if (w->rate <= 0) start_next(c);
    }
    if (w->rate > 0) {
        uv_timer_init(&w->loop, &w->timer);
        w->timer.data = w;
        w->next_t = cli_now_s();
        on_arrival(&w->timer);
    }
    uv_run(&w->loop, UV_RUN_DEFAULT);
}

/* ---- a blocking GET for /v1/models and /metrics ---------------------------------------- */

static int resolve(const char *host, int port, struct sockaddr_storage *out) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(host, ps, &hints, &ai) || !ai) return -1;
    memcpy(out, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return 0;
}

/* The body of GET path (Connection: close), malloc'd, or NULL. */
static char *http_get(const lg_opts *o, const struct sockaddr_storage *addr, const char *path) {
    int fd = socket(addr->ss_family, SOCK_STREAM, 0);
    if (fd < 0) return NULL;
    socklen_t al = addr->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    char req[1024];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s:%d\r\n%s%s%sConnection: close\r\n\r\n", path,
                     o->host, o->port, o->api_key[0] ? "Authorization: Bearer " : "", o->api_key,
                     o->api_key[0] ? "\r\n" : "");
    if (connect(fd, (const struct sockaddr *)addr, al) || write(fd, req, (size_t)n) != n) goto fail;
    for (;;) {
        if (grow(&buf, &cap, len + 65536 + 1)) goto fail;
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    close(fd);
    if (!buf) return NULL;
    buf[len] = 0;
    char *body = strstr(buf, "\r\n\r\n");
    if (!body || strncmp(buf, "HTTP/1.1 200", 12)) {
        free(buf);
        return NULL;
    }
    body += 4;
    if (strcasestr(buf, "transfer-encoding: chunked") && strcasestr(buf, "transfer-encoding: chunked") < body) {
        char *o2 = buf, *p = body;   /* de-chunk in place */
        for (;;) {
            long sz = strtol(p, &p, 16);
            p = strstr(p, "\r\n");
            if (sz <= 0 || !p) break;
            p += 2;
            memmove(o2, p, (size_t)sz);
            o2 += sz;
            p += sz + 2;
        }
        *o2 = 0;
    } else {
        memmove(buf, body, strlen(body) + 1);
    }
    return buf;
fail:
    close(fd);
    free(buf);
    return NULL;
}

/* specd's host output seconds and tokens so far (from /metrics); -1 where absent. */
static void host_output(const lg_opts *o, const struct sockaddr_storage *addr, double *sec, double *tok) {
    *sec = *tok = -1;
    char *m = http_get(o, addr, "/metrics");
    if (!m) return;
    const char *p = strstr(m, "specd:host_output_seconds_total{"), *q = strstr(m, "specd:host_output_tokens_total{");
    if (p && (p = strchr(p, '}'))) *sec = atof(p + 1);
    if (q && (q = strchr(q, '}'))) *tok = atof(q + 1);
    free(m);
}

/* ---- levels and the report ------------------------------------------------------------- */

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p) {   /* v sorted */
    if (!n) return NAN;
    double k = (double)(n - 1) * p / 100.0;
    size_t lo = (size_t)k, hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (k - (double)lo);
}

static json_t *run_level(const lg_opts *o, const struct sockaddr_storage *addr, int conc, int n_req) {
    const int T = o->threads < conc ? o->threads : conc;
    lg_worker *w = calloc((size_t)T, sizeof *w);
    lg_result *res = calloc((size_t)n_req, sizeof *res);
    uv_thread_t *th = calloc((size_t)T, sizeof *th);
    atomic_int next = 0;
    double s0, k0, s1, k1;
    host_output(o, addr, &s0, &k0);
    const double t0 = cli_now_s();
    for (int t = 0; t < T; t++) {
        w[t].o = o, w[t].next = &next, w[t].n_req = n_req, w[t].res = res, w[t].addr = *addr;
        w[t].n_conns = conc / T + (t < conc % T);
        w[t].conns = calloc((size_t)w[t].n_conns, sizeof(lg_conn));
        if (o->rate > 0) {
            w[t].rate = o->rate / T;
            w[t].rng = mix(o->seed ^ o->salt ^ (uint64_t)(t + 1) << 48);
            w[t].queue = calloc((size_t)n_req, sizeof(int));
        }
        uv_loop_init(&w[t].loop);
        uv_thread_create(&th[t], worker_main, &w[t]);
    }
    for (int t = 0; t < T; t++) uv_thread_join(&th[t]);
    const double wall = cli_now_s() - t0;
    host_output(o, addr, &s1, &k1);
    dvec gaps = {0}, ttft = {0}, tpot = {0}, e2e = {0}, wait = {0};
    long out_tok = 0;
    int ok = 0;
    char first_error[256] = "";
    for (int t = 0; t < T; t++) {
        for (size_t i = 0; i < w[t].gaps.n; i++) dvec_push(&gaps, w[t].gaps.v[i]);
        if (!first_error[0] && w[t].first_error[0]) snprintf(first_error, sizeof first_error, "%s", w[t].first_error);
    }
    for (int i = 0; i < n_req; i++) {
        if (!res[i].ok) continue;
        ok++;
        out_tok += res[i].tokens;
        if (res[i].ttft >= 0) dvec_push(&ttft, res[i].ttft);
        if (res[i].tpot >= 0) dvec_push(&tpot, res[i].tpot);
        dvec_push(&e2e, res[i].e2e);
        if (o->rate > 0) dvec_push(&wait, res[i].wait);
    }
    json_t *row = json_object();
    json_object_set_new(row, "concurrency", json_integer(conc));
    json_object_set_new(row, "threads", json_integer(T));
    json_object_set_new(row, "requests", json_integer(n_req));
    json_object_set_new(row, "failed", json_integer(n_req - ok));
    json_object_set_new(row, "wall_s", json_real(wall));
    json_object_set_new(row, "requests_per_s", json_real(ok / wall));
    json_object_set_new(row, "output_tokens", json_integer(out_tok));
    json_object_set_new(row, "output_tokens_per_s", json_real((double)out_tok / wall));
    if (o->rate > 0) json_object_set_new(row, "request_rate", json_real(o->rate));
    dvec *vs[5] = {&ttft, &gaps, &tpot, &e2e, &wait};
    const char *names[5] = {"ttft", "itl", "tpot", "e2e", "queue_wait"};
    for (int k = 0; k < (o->rate > 0 ? 5 : 4); k++) {
        qsort(vs[k]->v, vs[k]->n, sizeof(double), cmp_d);
        const int ps[3] = {50, 90, 99};
        for (int j = 0; j < 3; j++) {
            char key[32];
            snprintf(key, sizeof key, "%s_p%d_ms", names[k], ps[j]);
            json_object_set_new(row, key, vs[k]->n ? json_real(1000 * pct(vs[k]->v, vs[k]->n, ps[j])) : json_null());
        }
    }
    if (s0 >= 0 && s1 >= 0 && k1 > k0)
        json_object_set_new(row, "host_us_per_token", json_real(1e6 * (s1 - s0) / (k1 - k0)));
    if (first_error[0]) json_object_set_new(row, "first_error", json_string(first_error));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < w[t].n_conns; i++) free(w[t].conns[i].req), free(w[t].conns[i].in), free(w[t].conns[i].ev);
        free(w[t].conns);
        free(w[t].gaps.v);
        free(w[t].queue);
        uv_loop_close(&w[t].loop);
    }
    free(gaps.v), free(ttft.v), free(tpot.v), free(e2e.v), free(wait.v);
    free(w), free(res), free(th);
    return row;
}

static double jnum(json_t *row, const char *k) {
    json_t *v = json_object_get(row, k);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: specd loadgen [--url http://127.0.0.1:8000] [--endpoint completions|chat]\n"
            "                     [--concurrency 1,16,64,256] [--num-prompts N] [--input-len 128]\n"
            "                     [--output-len 128] [--prompt-kind tokens|words] [--token-range 10,1000]\n"
            "                     [--threads 4] [--model ID] [--api-key KEY] [--seed 0] [--no-ignore-eos]\n"
            "                     [--request-rate R] [--out FILE.json]\n"
            "Streams requests to an OpenAI-compatible server and reports, per level, requests/s,\n"
            "output tokens/s, TTFT / ITL / TPOT p50 p90 p99 and (specd) host us per output token.\n"
            "Each level keeps `concurrency` streams in flight until its requests have finished\n"
            "(--num-prompts, default four per stream and at least 64), spread over --threads\n"
            "event loops. Run a level at --threads N and 2N: when the figure does not move, the\n"
            "server is the limit, not this client. --request-rate R: an open loop instead, requests\n"
            "arriving at R per second (Poisson) onto at most `concurrency` streams, those that find\n"
            "none free waiting in the client (queue_wait percentiles; TTFT counts from the send).\n"
            "Prompts are seeded by --seed, the level and the\n"
            "request: runs to compare want different seeds (else the second finds the first's\n"
            "prompts in the server's prefix cache).\n");
}

int cmd_loadgen(int argc, char **argv) {
    lg_opts o = {.port = 8000, .in_len = 128, .out_len = 128, .threads = 4, .ignore_eos = 1, .tok_lo = 10,
                 .tok_hi = 1000};
    snprintf(o.host, sizeof o.host, "127.0.0.1");
    const char *levels = "1,16,64,256", *out_path = NULL;
    int num = 0;
    if (getenv("OPENAI_API_KEY")) snprintf(o.api_key, sizeof o.api_key, "%s", getenv("OPENAI_API_KEY"));
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--no-ignore-eos")) {
            o.ignore_eos = 0;
            continue;
        }
        if (!v) {
            fprintf(stderr, "specd loadgen: %s needs a value (or is unknown)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--url")) {
            const char *h = strncmp(v, "http://", 7) ? NULL : v + 7;
            const char *colon = h ? strchr(h, ':') : NULL, *slash = h ? strchr(h, '/') : NULL;
            size_t hl = h ? (colon ? (size_t)(colon - h) : slash ? (size_t)(slash - h) : strlen(h)) : 0;
            if (!h || !hl || hl >= sizeof o.host) bad = 1;
            else {
                memcpy(o.host, h, hl);
                o.host[hl] = 0;
                o.port = colon ? atoi(colon + 1) : 80;
                bad = o.port <= 0 || o.port > 65535;
            }
        } else if (!strcmp(a, "--endpoint")) {
            bad = strcmp(v, "chat") && strcmp(v, "completions");
            o.chat = !strcmp(v, "chat");
        } else if (!strcmp(a, "--concurrency")) levels = v;
        else if (!strcmp(a, "--num-prompts")) bad = cli_int(v, 1, 1 << 24, &num);
        else if (!strcmp(a, "--input-len")) bad = cli_int(v, 1, 1 << 20, &o.in_len);
        else if (!strcmp(a, "--output-len")) bad = cli_int(v, 1, 1 << 20, &o.out_len);
        else if (!strcmp(a, "--threads")) bad = cli_int(v, 1, 256, &o.threads);
        else if (!strcmp(a, "--request-rate")) {
            float rr = 0;
            bad = cli_float(v, 0, 1e6, &rr);
            o.rate = rr;
        }
        else if (!strcmp(a, "--prompt-kind")) {
            bad = strcmp(v, "tokens") && strcmp(v, "words");
            o.words = !strcmp(v, "words");
        } else if (!strcmp(a, "--token-range")) bad = sscanf(v, "%d,%d", &o.tok_lo, &o.tok_hi) != 2 || o.tok_lo < 0 ||
                                                       o.tok_hi < o.tok_lo;
        else if (!strcmp(a, "--model")) bad = snprintf(o.model, sizeof o.model, "%s", v) >= (int)sizeof o.model ||
                                              strpbrk(v, "\"\\");
        else if (!strcmp(a, "--api-key")) bad = snprintf(o.api_key, sizeof o.api_key, "%s", v) >= (int)sizeof o.api_key;
        else if (!strcmp(a, "--seed")) bad = cli_u64(v, &o.seed);
        else if (!strcmp(a, "--out")) out_path = v;
        else {
            fprintf(stderr, "specd loadgen: unknown option %s\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "specd loadgen: bad value for %s: %s\n", a, v);
            return 2;
        }
    }
    int conc[64], n_lv = 0;
    for (const char *p = levels; *p;) {
        char *end;
        long c = strtol(p, &end, 10);
        if (end == p || c < 1 || c > 100000 || (*end && *end != ',') || n_lv == 64) {
            fprintf(stderr, "specd loadgen: bad --concurrency list: %s\n", levels);
            return 2;
        }
        conc[n_lv++] = (int)c;
        p = *end ? end + 1 : end;
    }
    struct sockaddr_storage addr;
    if (resolve(o.host, o.port, &addr)) {
        fprintf(stderr, "specd loadgen: cannot resolve %s\n", o.host);
        return 1;
    }
    if (!o.model[0]) {   /* the server's first model */
        char *m = http_get(&o, &addr, "/v1/models");
        json_t *j = m ? json_loads(m, 0, NULL) : NULL;
        const char *id = json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        if (id && !strpbrk(id, "\"\\")) snprintf(o.model, sizeof o.model, "%s", id);
        json_decref(j);
        free(m);
        if (!o.model[0]) {
            fprintf(stderr, "specd loadgen: GET http://%s:%d/v1/models gave no model id (is the server up?)\n", o.host,
                    o.port);
            return 1;
        }
    }
    json_t *rows = json_array();
    printf("| streams | threads | requests | failed | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
           "| TPOT p50 ms | host us/tok |\n|---:|---:|---:|---:|---:|---:|---|---|---:|---:|\n");
    for (int li = 0; li < n_lv; li++) {
        const int c = conc[li];
        int n = num ? num : (4 * c < 64 ? 64 : 4 * c);
        o.salt = (uint64_t)li << 32 | (uint64_t)c;
        json_t *row = run_level(&o, &addr, c, n);
        char f[6][24];
        const char *keys[6] = {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "host_us_per_token"};
        for (int k = 0; k < 6; k++) {
            const double v = jnum(row, keys[k]);
            if (isnan(v)) snprintf(f[k], sizeof f[k], "-");
            else snprintf(f[k], sizeof f[k], k < 2 ? "%.1f" : "%.2f", v);
        }
        printf("| %d | %d | %d | %d | %.2f | %.1f | %s / %s | %s / %s | %s | %s |\n", c,
               (int)json_integer_value(json_object_get(row, "threads")), n,
               (int)json_integer_value(json_object_get(row, "failed")), jnum(row, "requests_per_s"),
               jnum(row, "output_tokens_per_s"), f[0], f[1], f[2], f[3], f[4], f[5]);
        if (json_object_get(row, "first_error"))
            printf("  first error: %s\n", json_string_value(json_object_get(row, "first_error")));
        fflush(stdout);
        json_array_append_new(rows, row);
    }
    int rc = 0;
    if (out_path) {
        json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:O}", "model", o.model, "endpoint", o.chat ? "chat" : "completions",
                                "input_len", o.in_len, "output_len", o.out_len, "results", rows);
        if (!doc || json_dump_file(doc, out_path, JSON_INDENT(1))) {
            fprintf(stderr, "specd loadgen: cannot write %s\n", out_path);
            rc = 1;
        }
        json_decref(doc);
    }
    size_t i;
    json_t *row;
    json_array_foreach(rows, i, row) if (json_integer_value(json_object_get(row, "failed"))) rc = 1;
    json_decref(rows);
    return rc;
}
