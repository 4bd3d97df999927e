/* Tool calls in model output: the incremental parser (see toolcall.h for the contract).
 *
 * The parser keeps the text it has not consumed in buf. In TEXT it looks for a marker;
 * at one it opens a structure (a call object, Mistral's array or name form) and remembers
 * where the held text began (mark) and where plain text would resume if the structure
 * turns out not to be a call (resume). Until a call's name has been read the structure is
 * "pending": a failure gives buf[mark, resume) back as content and rescans from resume. At
 * the name the call is committed; from then on a failure ends the call and the bytes from
 * the failing one on are text again. Every decision waits until the bytes that decide it
 * are there (or the final feed says none will come), which is what makes the result
 * independent of how the text was cut. */
#include "server/toolcall.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "engine/core/err.h"
#include "server/sbuf.h"

#define TC_MAX_DEPTH 64
#define TC_MAX_NAME 256
#define TC_MAX_KEY 16

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* ---- a JSON value scanner, one byte at a time ----------------------------------------------
 * It only validates (no values are built): js_byte says whether a byte continues the value,
 * ends it (END: the byte was its last; END_BEFORE: it ended just before this byte, which a
 * number only knows when the next byte comes), or cannot belong to it. */

enum { JS_MORE, JS_END, JS_END_BEFORE, JS_ERR };
enum { J_VALUE, J_ARR_FIRST, J_STR, J_STR_ESC, J_STR_HEX, J_NUM, J_LIT, J_AFTER, J_KEY,
       J_KEY_REQ, J_COLON, J_DONE };
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

typedef struct {
    char stack[TC_MAX_DEPTH];
    int depth, st, sub, is_key, num;
    const char *lit;
} js_scan;

static void js_init(js_scan *s) { memset(s, 0, sizeof *s); }

static int js_value_done(js_scan *s) {
    if (s->depth == 0) {
        s->st = J_DONE;
        return JS_END;
    }
    s->st = J_AFTER;
    return JS_MORE;
}

static int js_value_start(js_scan *s, char c) {
    switch (c) {
    case '{': case '[':
        if (s->depth == TC_MAX_DEPTH) return JS_ERR;
        s->stack[s->depth++] = c;
        s->st = c == '{' ? J_KEY : J_ARR_FIRST;
        return JS_MORE;
    case '"': s->st = J_STR; s->is_key = 0; return JS_MORE;
    case 't': s->lit = "true"; break;
    case 'f': s->lit = "false"; break;
    case 'n': s->lit = "null"; break;
    case '-': s->st = J_NUM; s->num = N_MINUS; return JS_MORE;
    default:
        if (c < '0' || c > '9') return JS_ERR;
        s->st = J_NUM;
        s->num = c == '0' ? N_ZERO : N_INT;
        return JS_MORE;
    }
    s->st = J_LIT;
    s->sub = 1;
    return JS_MORE;
}

static int js_num_complete(const js_scan *s) {
    return s->num == N_ZERO || s->num == N_INT || s->num == N_FRAC || s->num == N_EXP;
}

/* 1: c continues the number; 0: it does not. */
static int js_num_next(js_scan *s, char c) {
    int digit = c >= '0' && c <= '9';
    switch (s->num) {
    case N_MINUS: if (digit) { s->num = c == '0' ? N_ZERO : N_INT; return 1; } return 0;
    case N_ZERO: case N_INT: case N_FRAC:
        if (digit && s->num != N_ZERO) return 1;
        if (c == '.' && s->num != N_FRAC) { s->num = N_DOT; return 1; }
        if (c == 'e' || c == 'E') { s->num = N_E; return 1; }
        return 0;
    case N_DOT: if (digit) { s->num = N_FRAC; return 1; } return 0;
    case N_E:
        if (c == '+' || c == '-') { s->num = N_ESIGN; return 1; }
        if (digit) { s->num = N_EXP; return 1; }
        return 0;
    case N_ESIGN: if (digit) { s->num = N_EXP; return 1; } return 0;
    default: return digit;
    }
}

static int js_byte(js_scan *s, char c) {
    switch (s->st) {
    case J_VALUE: case J_ARR_FIRST:
        if (is_ws(c)) return JS_MORE;
        if (s->st == J_ARR_FIRST && c == ']') {
            s->depth--;
            return js_value_done(s);
        }
        return js_value_start(s, c);
    case J_STR:
        if (c == '"') {
            if (s->is_key) {
                s->st = J_COLON;
                return JS_MORE;
            }
            return js_value_done(s);
        }
        if (c == '\\') s->st = J_STR_ESC;
        return (unsigned char)c < 0x20 ? JS_ERR : JS_MORE;
    case J_STR_ESC:
        if (c == 'u') {
            s->st = J_STR_HEX;
            s->sub = 0;
            return JS_MORE;
        }
        if (!strchr("\"\\/bfnrt", c) || !c) return JS_ERR;
        s->st = J_STR;
        return JS_MORE;
    case J_STR_HEX:
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return JS_ERR;
        if (++s->sub == 4) s->st = J_STR;
        return JS_MORE;
    case J_NUM: {
        if (js_num_next(s, c)) return JS_MORE;
        if (!js_num_complete(s)) return JS_ERR;
        if (js_value_done(s) == JS_END) return JS_END_BEFORE;
        int r = js_byte(s, c);  /* inside a container: c is the separator or the closer */
        return r == JS_END ? JS_END : r;
    }
    case J_LIT:
        if (c != s->lit[s->sub]) return JS_ERR;
        if (!s->lit[++s->sub]) return js_value_done(s);
        return JS_MORE;
    case J_AFTER: {
        char top = s->stack[s->depth - 1];
        if (is_ws(c)) return JS_MORE;
        if (c == ',') {
            s->st = top == '{' ? J_KEY_REQ : J_VALUE;
            return JS_MORE;
        }
        if ((c == '}' && top == '{') || (c == ']' && top == '[')) {
            s->depth--;
            return js_value_done(s);
        }
        return JS_ERR;
    }
    case J_KEY: case J_KEY_REQ:
        if (is_ws(c)) return JS_MORE;
        if (c == '"') {
            s->st = J_STR;
            s->is_key = 1;
            return JS_MORE;
        }
        if (c == '}' && s->st == J_KEY) {
            s->depth--;
            return js_value_done(s);
        }
        return JS_ERR;
    case J_COLON:
        if (is_ws(c)) return JS_MORE;
        if (c != ':') return JS_ERR;
        s->st = J_VALUE;
        return JS_MORE;
    default:
        return JS_ERR;
    }
}

/* ---- the parser ------------------------------------------------------------------------------ */

/* States. S_OBJ is one call object ({"name": ..., "arguments": ...}); after it, hermes
 * expects </tool_call> (S_H_CLOSE), llama3_json an optional ';' and another object
 * (S_L_SEP, S_L_NEXT), mistral's array ',' or ']' (S_M_SEP, S_M_ELEM). Mistral's name form
 * is S_M_NAME, S_M_ARGSTAG ([ARGS]) and S_M_ARGVAL. */
enum { S_TEXT, S_OBJ, S_H_CLOSE, S_L_SEP, S_L_NEXT, S_M_START, S_M_ELEM, S_M_SEP, S_M_NAME,
       S_M_ARGSTAG, S_M_ARGVAL, S_H_TAG };
/* Call-object sub-states. */
enum { CO_OPEN, CO_KEY0, CO_KEY, CO_KEYSTR, CO_KEYESC, CO_COLON, CO_VAL, CO_AFTER };
enum { K_OTHER, K_NAME, K_ARGS };

static const char HERMES_OPEN[] = "<tool_call>", HERMES_CLOSE[] = "</tool_call>";
static const char PYTHON_TAG[] = "<|python_tag|>";
static const char MISTRAL_TAG[] = "[TOOL_CALLS]", MISTRAL_ARGS[] = "[ARGS]";

typedef struct {
    char id[40];
    char *name;
    sbuf args;
    size_t sent;               /* argument bytes already in a delta */
    int hdr_sent;              /* the delta with id and name went out */
} tc_call;

struct tc_parser {
    tc_format format;
    int max_calls;
    char **names;              /* declared tools (llama3_json bare form) */
    int n_names;
    uint64_t rng;              /* 0: getrandom */
    sbuf buf;                /* unconsumed input from index 0 */
    size_t pos;                /* next byte to look at */
    size_t mark, resume;       /* pending structure: held text [mark, resume) */
    int pending;
    int st, ended;
    int at_start;              /* nothing given out yet and no structure seen */
    int after_call;            /* leading whitespace is dropped */
    int bare;                  /* this llama3_json sequence began without a tag */
    int elem_first;            /* S_M_ELEM: the array's first element (still pending) */
    int forced_array;          /* the whole output is a JSON array of calls */
    int forced;                /* forced_array or a named call: no content at all */
    /* the call being read */
    int co, key_kind, key_len, has_name, has_args, in_call, committed, discard, cur;
    int val_started;           /* the value after the key (or [ARGS]) has begun */
    char key[TC_MAX_KEY + 1];
    js_scan js;
    sbuf name, pre_args;     /* raw name bytes; arguments read before the name */
    size_t tag_got;            /* bytes of a tag matched so far (S_M_ARGSTAG) */
    tc_call *calls;
    int n_calls, cap_calls;
    sbuf out;                /* content since the last take */
    sbuf gap;                /* whitespace between content and the calls after it */
    int content_seen;          /* some content went out */
    int oom;
};

int tc_format_parse(const char *name, int *f) {
    static const char *const names[] = {"none", "hermes", "llama3_json", "mistral"};
    if (!strcmp(name, "auto")) {
        *f = -1;
        return 0;
    }
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, names[i])) {
            *f = i;
            return 0;
        }
    return -1;
}

const char *tc_format_name(tc_format f) {
    switch (f) {
    case TC_HERMES: return "hermes";
    case TC_LLAMA3_JSON: return "llama3_json";
    case TC_MISTRAL: return "mistral";
    default: return "none";
    }
}

tc_format tc_detect(const char *src) {
    if (!src) return TC_NONE;
    if (strstr(src, HERMES_OPEN)) return TC_HERMES;
    if (strstr(src, MISTRAL_TAG)) return TC_MISTRAL;
    if (strstr(src, PYTHON_TAG) || strstr(src, "\"parameters\": dictionary")) return TC_LLAMA3_JSON;
    return TC_NONE;
}

static void open_pending(tc_parser *p, size_t mark, size_t resume, size_t pos, int st);
static void call_reset(tc_parser *p);
static int commit(tc_parser *p);

tc_parser *tc_parser_new(const tc_config *cfg) {
    if (cfg->format == TC_NONE) return NULL;
    tc_parser *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->format = cfg->format;
    p->max_calls = cfg->max_calls;
    p->rng = cfg->id_seed;
    p->at_start = 1;
    p->forced_array = cfg->forced_array;
    p->forced = cfg->forced_array || cfg->forced_name;
    size_t i;
    json_t *t;
    json_array_foreach(cfg->tools, i, t) {
        const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (!n) continue;
        char **nn = realloc(p->names, (size_t)(p->n_names + 1) * sizeof *nn);
        if (!nn) goto fail;
        p->names = nn;
        if (!(p->names[p->n_names] = strdup(n))) goto fail;
        p->n_names++;
    }
    if (cfg->forced_array) {   /* as if a marker had just been read */
        open_pending(p, 0, 0, 0, S_M_START);
        p->at_start = 0;
    } else if (cfg->forced_name) {   /* the call is known: everything is its arguments */
        call_reset(p);
        if (sbuf_add(&p->name, cfg->forced_name, strlen(cfg->forced_name)) || commit(p)) goto fail;
        js_init(&p->js);
        p->val_started = 0;
        p->st = S_M_ARGVAL;
        p->at_start = 0;
    }
    return p;
fail:
    tc_parser_free(p);
    return NULL;
}

void tc_parser_free(tc_parser *p) {
    if (!p) return;
    for (int i = 0; i < p->n_names; i++) free(p->names[i]);
    free(p->names);
    for (int i = 0; i < p->n_calls; i++) {
        free(p->calls[i].name);
        free(p->calls[i].args.p);
    }
    free(p->calls);
    free(p->buf.p);
    free(p->name.p);
    free(p->pre_args.p);
    free(p->out.p);
    free(p->gap.p);
    free(p);
}

static void emit(tc_parser *p, const char *s, size_t n) {
    if (!n) return;
    if (sbuf_add(&p->out, s, n)) p->oom = 1;
    p->at_start = 0;
}

static size_t leading_ws(const char *s, size_t n) {
    size_t k = 0;
    while (k < n && is_ws(s[k])) k++;
    return k;
}

static size_t trailing_ws(const char *s, size_t n) {
    size_t k = 0;
    while (k < n && is_ws(s[n - 1 - k])) k++;
    return k;
}

/* Text that is content for sure. Right after a call its leading whitespace is dropped, and
 * when content came before the call, the whitespace that stood between that content and
 * the call (or else this leading whitespace) goes out first as the separator. */
static void give(tc_parser *p, const char *s, size_t n) {
    if (!n || p->forced) return;   /* forced: the output is JSON, never prose */
    size_t lead = p->after_call ? leading_ws(s, n) : 0;
    if (lead == n && p->after_call) return;
    if (p->after_call && p->content_seen) {
        if (p->gap.len) emit(p, p->gap.p, p->gap.len);
        else emit(p, s, lead);
    }
    emit(p, s + lead, n - lead);
    if (n > lead) p->content_seen = 1;
    p->after_call = 0;
    p->gap.len = 0;
}

static void make_id(tc_parser *p, char *id, size_t cap) {
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    /* Mistral's template insists on 9 alphanumerics; OpenAI's ids are call_ + 24. */
    int mistral = p->format == TC_MISTRAL;
    size_t n = mistral ? 9 : 24, o = 0;
    unsigned char r[24];
    if (p->rng) {
        for (size_t i = 0; i < n; i++) {
            p->rng ^= p->rng >> 12, p->rng ^= p->rng << 25, p->rng ^= p->rng >> 27;
            r[i] = (unsigned char)((p->rng * 2685821657736338717ULL) >> 56);
        }
    } else if (getrandom(r, n, 0) != (ssize_t)n) {
        for (size_t i = 0; i < n; i++) r[i] = (unsigned char)(rand() & 0xff);
    }
    if (!mistral) o = (size_t)snprintf(id, cap, "call_");
    for (size_t i = 0; i < n && o + 1 < cap; i++) id[o++] = al[r[i] % (sizeof al - 1)];
    id[o] = 0;
}

/* ---- structure begin / commit / end ------------------------------------------------------------ */

static void call_reset(tc_parser *p) {
    p->co = CO_OPEN;
    p->has_name = p->has_args = p->committed = p->discard = 0;
    p->in_call = 1;
    p->cur = -1;
    p->name.len = 0;
    p->pre_args.len = 0;
}

/* Open a pending structure: held text is [mark, resume), parsing goes on at pos. */
static void open_pending(tc_parser *p, size_t mark, size_t resume, size_t pos, int st) {
    p->pending = 1;
    p->mark = mark;
    p->resume = resume;
    p->pos = pos;
    p->st = st;
    p->in_call = 0;
}

/* Not a call after all: the held text is content again. */
static void rollback(tc_parser *p) {
    give(p, p->buf.p + p->mark, p->resume - p->mark);
    p->pending = 0;
    p->in_call = 0;
    p->at_start = 0;
    p->bare = 0;
    p->pos = p->resume;
    p->st = S_TEXT;
}

static int known_tool(const tc_parser *p, const char *name) {
    for (int i = 0; i < p->n_names; i++)
        if (!strcmp(p->names[i], name)) return 1;
    return 0;
}

/* The name is read: decode it and make the call. 0, or -1 when it is no call. */
static int commit(tc_parser *p) {
    char *name = NULL;
    if (!p->name.len || p->name.len > TC_MAX_NAME) return -1;
    if (memchr(p->name.p, '\\', p->name.len)) {  /* escapes: let jansson decode them */
        char *q = malloc(p->name.len + 3);
        if (!q) return -1;
        q[0] = '"';
        memcpy(q + 1, p->name.p, p->name.len);
        memcpy(q + 1 + p->name.len, "\"", 2);
        json_t *v = json_loads(q, JSON_DECODE_ANY, NULL);
        free(q);
        if (json_is_string(v) && json_string_length(v) && !memchr(json_string_value(v), 0, json_string_length(v)))
            name = strdup(json_string_value(v));
        json_decref(v);
    } else {
        name = strndup(p->name.p, p->name.len);
    }
    if (!name || (p->bare && !known_tool(p, name))) {
        free(name);
        return -1;
    }
    p->pending = 0;
    p->committed = 1;
    if (p->max_calls && p->n_calls >= p->max_calls) {
        p->discard = 1;
        free(name);
        return 0;
    }
    if (p->n_calls == p->cap_calls) {
        int nc = p->cap_calls ? p->cap_calls * 2 : 4;
        tc_call *n = realloc(p->calls, (size_t)nc * sizeof *n);
        if (!n) {
            free(name);
            p->oom = 1;
            p->discard = 1;
            return 0;
        }
        p->calls = n;
        p->cap_calls = nc;
    }
    tc_call *c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    c->name = name;
    make_id(p, c->id, sizeof c->id);
    if (sbuf_add(&c->args, p->pre_args.p ? p->pre_args.p : "", p->pre_args.len)) p->oom = 1;
    p->cur = p->n_calls++;
    return 0;
}

static void args_add(tc_parser *p, char c) {
    if (!p->committed) {
        if (sbuf_add(&p->pre_args, &c, 1)) p->oom = 1;
    } else if (!p->discard && sbuf_add(&p->calls[p->cur].args, &c, 1)) {
        p->oom = 1;
    }
}

/* The call is complete (or cut off): give it "{}" when it had no arguments. */
static void call_end(tc_parser *p) {
    if (p->committed && !p->discard && !p->has_args && sbuf_add(&p->calls[p->cur].args, "{}", 2)) p->oom = 1;
    p->in_call = 0;
    p->after_call = 1;
    p->at_start = 0;
}

/* Something that cannot belong where it is: before the commit, no call; after it, the
 * call ends and text resumes at pos. */
static void fail(tc_parser *p) {
    if (p->pending) {
        rollback(p);
        return;
    }
    if (p->in_call) call_end(p);
    p->bare = 0;
    p->st = S_TEXT;
}

/* After a complete call object. */
static void object_done(tc_parser *p) {
    call_end(p);
    p->st = p->forced_array || p->format == TC_MISTRAL ? S_M_SEP : p->format == TC_HERMES ? S_H_CLOSE : S_L_SEP;
}

/* ---- TEXT --------------------------------------------------------------------------------------- */

const char *tc_marker(tc_format f) {
    return f == TC_HERMES ? HERMES_OPEN : f == TC_MISTRAL ? MISTRAL_TAG : f == TC_LLAMA3_JSON ? PYTHON_TAG : NULL;
}

static const char *marker(const tc_parser *p, size_t *len) {
    const char *m = tc_marker(p->format);
    *len = strlen(m);
    return m;
}

/* Returns 1 when it moved on to a structure, 0 when it needs more text. Whitespace before
 * a marker is not content: it is kept as the separator for content after the call. */
static int step_text(tc_parser *p, int final) {
    const char *t = p->buf.p + p->pos;
    size_t n = p->buf.len - p->pos, mlen;
    const char *m = marker(p, &mlen);
    const char *hit = n ? memmem(t, n, m, mlen) : NULL;
    size_t h = hit ? (size_t)(hit - t) : n;
    int bare = 0;
    if (p->format == TC_LLAMA3_JSON && p->at_start) {   /* bare JSON only at the very start */
        size_t lw = leading_ws(t, n);
        if (lw < n && t[lw] == '{' && lw < h) {
            h = lw;
            bare = 1;
        }
    }
    if (hit || bare) {
        size_t ws_start = h - trailing_ws(t, h);
        if (ws_start) give(p, t, ws_start);
        if (!p->after_call) {
            p->gap.len = 0;
            if (sbuf_add(&p->gap, t + ws_start, h - ws_start)) p->oom = 1;
        }
        size_t mark = p->pos + ws_start;
        p->at_start = 0;
        if (bare) {
            p->bare = 1;
            open_pending(p, mark, mark, p->pos + h, S_OBJ);
            call_reset(p);
        } else {
            p->bare = 0;
            size_t after = p->pos + h + mlen;
            open_pending(p, mark, after, after,
                         p->format == TC_HERMES ? S_OBJ : p->format == TC_MISTRAL ? S_M_START : S_L_NEXT);
            if (p->format == TC_HERMES) call_reset(p);
        }
        return 1;
    }
    if (final) {
        give(p, t, n);
        p->pos = p->buf.len;
        return 0;
    }
    /* Hold back a suffix that may start the marker, and trailing whitespace (it is the
     * separator, or dropped, if a marker follows). */
    size_t hold = 0;
    for (size_t k = mlen - 1 < n ? mlen - 1 : n; k > 0; k--)
        if (!memcmp(t + n - k, m, k)) {
            hold = k;
            break;
        }
    size_t upto = (n - hold) - trailing_ws(t, n - hold);
    if (upto) give(p, t, upto);
    p->pos += upto;
    return 0;
}

/* ---- call objects ------------------------------------------------------------------------------ */

static int key_kind(const tc_parser *p) {
    if (!strcmp(p->key, "name") && !p->has_name) return K_NAME;
    if ((!strcmp(p->key, "arguments") || !strcmp(p->key, "parameters")) && !p->has_args) return K_ARGS;
    return K_OTHER;
}

/* One byte of a call object. Returns 1 consumed, 0 not consumed (state changed), -1 fail. */
static int obj_byte(tc_parser *p, char c) {
    switch (p->co) {
    case CO_OPEN:
        if (is_ws(c)) return 1;
        if (c != '{') return -1;
        p->co = CO_KEY0;
        return 1;
    case CO_KEY0: case CO_KEY:
        if (is_ws(c)) return 1;
        if (c == '"') {
            p->co = CO_KEYSTR;
            p->key_len = 0;
            p->key[0] = 0;
            return 1;
        }
        if (c == '}' && p->co == CO_KEY0) {
            if (!p->committed) return -1;
            object_done(p);
            return 1;
        }
        return -1;
    case CO_KEYSTR: case CO_KEYESC:
        if (p->co == CO_KEYSTR && c == '"') {
            p->co = CO_COLON;
            return 1;
        }
        if ((unsigned char)c < 0x20) return -1;
        p->co = p->co == CO_KEYSTR && c == '\\' ? CO_KEYESC : CO_KEYSTR;
        if (p->key_len < TC_MAX_KEY) p->key[p->key_len++] = c;
        else p->key[0] = '\\';   /* too long for any key we know */
        p->key[p->key_len] = 0;
        return 1;
    case CO_COLON:
        if (is_ws(c)) return 1;
        if (c != ':') return -1;
        p->co = CO_VAL;
        p->key_kind = key_kind(p);
        p->val_started = 0;
        js_init(&p->js);
        return 1;
    case CO_VAL: {
        int started = p->val_started;
        if (!started && is_ws(c)) return 1;
        p->val_started = 1;
        if (p->key_kind == K_NAME && !started && c != '"') return -1;
        int r = js_byte(&p->js, c);
        if (r == JS_ERR) return -1;
        if (r == JS_END_BEFORE) {
            p->co = CO_AFTER;
            return 0;
        }
        if (p->key_kind == K_ARGS) {
            p->has_args = 1;
            args_add(p, c);
        } else if (p->key_kind == K_NAME && (r == JS_MORE) && started) {
            if (sbuf_add(&p->name, &c, 1)) p->oom = 1;
        }
        if (r == JS_END) {
            p->co = CO_AFTER;
            if (p->key_kind == K_NAME) {
                p->has_name = 1;
                if (commit(p)) return -1;
            }
        }
        return 1;
    }
    case CO_AFTER:
        if (is_ws(c)) return 1;
        if (c == ',') {
            p->co = CO_KEY;
            return 1;
        }
        if (c != '}' || !p->committed) return -1;
        object_done(p);
        return 1;
    }
    return -1;
}

/* ---- the other structure states, one byte each ---------------------------------------------------
 * Each returns 1 (consumed), 0 (not consumed, state changed) or -1 (fail). */

static int struct_byte(tc_parser *p, char c) {
    switch (p->st) {
    case S_OBJ:
        return obj_byte(p, c);
    case S_H_CLOSE:
        if (is_ws(c)) return 1;
        p->tag_got = 0;
        p->st = S_H_TAG;   /* matched in step_struct: needs a look-ahead */
        return 0;
    case S_L_NEXT:   /* after <|python_tag|> or ';': another object must come */
        if (is_ws(c)) return 1;
        if (c != '{') return -1;
        call_reset(p);
        p->st = S_OBJ;
        return 0;
    case S_L_SEP:
        if (is_ws(c)) return 1;
        if (c != ';') {
            fail(p);
            return 0;
        }
        open_pending(p, p->pos, p->pos + 1, p->pos + 1, S_L_NEXT);
        return 0;
    case S_M_START:
        if (is_ws(c)) return 1;
        if (c == '[') {
            p->st = S_M_ELEM;
            p->elem_first = 1;
            return 1;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            call_reset(p);
            p->st = S_M_NAME;
            return 0;
        }
        return -1;
    case S_M_ELEM:
        if (is_ws(c)) return 1;
        if (c != '{') {
            if (p->elem_first && c == ']') {   /* an empty list: no calls, nothing to show */
                p->pending = 0;
                p->after_call = 1;
                p->st = S_TEXT;
                return 1;
            }
            return -1;
        }
        if (!p->elem_first) open_pending(p, p->pos, p->pos, p->pos, S_M_ELEM);
        call_reset(p);
        p->st = S_OBJ;
        return 0;
    case S_M_SEP:
        if (is_ws(c)) return 1;
        if (c == ',') {
            p->st = S_M_ELEM;
            p->elem_first = 0;
            return 1;
        }
        if (c == ']') {
            p->st = S_TEXT;
            return 1;
        }
        fail(p);
        return 0;
    case S_M_NAME: {
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '-' || c == '.';
        if (ok) {
            if (p->name.len >= TC_MAX_NAME) return -1;
            if (sbuf_add(&p->name, &c, 1)) p->oom = 1;
            return 1;
        }
        if (c != '[') return -1;
        p->st = S_M_ARGSTAG;
        p->tag_got = 0;
        return 0;
    }
    case S_M_ARGSTAG:
        if (c != MISTRAL_ARGS[p->tag_got]) return -1;
        if (++p->tag_got < sizeof MISTRAL_ARGS - 1) return 1;
        p->has_name = 1;
        if (commit(p)) return -1;
        js_init(&p->js);
        p->val_started = 0;
        p->st = S_M_ARGVAL;
        return 1;
    case S_M_ARGVAL: {
        if (!p->val_started && is_ws(c)) return 1;
        p->val_started = 1;
        int r = js_byte(&p->js, c);
        if (r == JS_ERR) return -1;
        if (r == JS_END_BEFORE) {
            call_end(p);
            p->st = S_TEXT;
            return 0;
        }
        p->has_args = 1;
        args_add(p, c);
        if (r == JS_END) {
            call_end(p);
            p->st = S_TEXT;
        }
        return 1;
    }
    }
    return -1;
}

/* The end of the output inside a structure: a pending one is text again, a committed call
 * ends as it is. */
static void end_struct(tc_parser *p) {
    if (p->pending) {
        rollback(p);
        return;
    }
    if (p->in_call) call_end(p);
    p->st = S_TEXT;
}

/* Returns 1 when it made progress that may let another step run, 0 when it needs input. */
static int step_struct(tc_parser *p, int final) {
    while (p->pos < p->buf.len) {
        if (p->st == S_TEXT) return 1;
        if (p->st == S_H_TAG) {   /* the closing tag, at pos */
            size_t have = p->buf.len - p->pos, tl = sizeof HERMES_CLOSE - 1;
            size_t k = have < tl ? have : tl;
            if (memcmp(p->buf.p + p->pos, HERMES_CLOSE, k)) {
                p->st = S_TEXT;   /* no closing tag: the call stands, the rest is text */
                return 1;
            }
            if (k < tl) break;
            p->pos += tl;
            p->st = S_TEXT;
            return 1;
        }
        int r = struct_byte(p, p->buf.p[p->pos]);
        if (r < 0) {
            fail(p);
            return 1;
        }
        if (r > 0) p->pos++;
    }
    if (p->st == S_TEXT) return 1;
    if (!final) return 0;
    if (p->st == S_H_TAG) p->st = S_TEXT;   /* a partial closing tag: text */
    else end_struct(p);
    return 1;
}

int tc_feed(tc_parser *p, const char *s, size_t n, int final) {
    if (p->ended) return 0;
    if (sbuf_add(&p->buf, s, n)) return SPECD_ENOMEM;
    for (;;) {
        int progressed = p->st == S_TEXT ? step_text(p, final) : step_struct(p, final);
        if (!progressed && (p->st == S_TEXT || !final)) break;
        if (p->st == S_TEXT && p->pos == p->buf.len && !final) break;
    }
    if (final) p->ended = 1;
    /* Drop what no rollback can need any more. */
    size_t keep = p->pending ? p->mark : p->pos;
    if (keep) {
        memmove(p->buf.p, p->buf.p + keep, p->buf.len - keep);
        p->buf.len -= keep;
        p->buf.p[p->buf.len] = 0;
        p->pos -= keep;
        if (p->pending) {
            p->mark -= keep;
            p->resume -= keep;
        }
    }
    return p->oom ? SPECD_ENOMEM : 0;
}

void tc_take_content(tc_parser *p, const char **s, size_t *n) {
    *s = p->out.p ? p->out.p : "";
    *n = p->out.len;
    p->out.len = 0;
}

json_t *tc_take_deltas(tc_parser *p) {
    json_t *arr = NULL;
    for (int i = 0; i < p->n_calls; i++) {
        tc_call *c = &p->calls[i];
        if (c->hdr_sent && c->sent == c->args.len) continue;
        json_t *fn = json_object(), *d = json_object();
        json_object_set_new(d, "index", json_integer(i));
        if (!c->hdr_sent) {
            json_object_set_new(d, "id", json_string(c->id));
            json_object_set_new(d, "type", json_string("function"));
            json_object_set_new(fn, "name", json_string(c->name));
        }
        json_object_set_new(fn, "arguments", json_stringn(c->args.p ? c->args.p + c->sent : "", c->args.len - c->sent));
        json_object_set_new(d, "function", fn);
        c->hdr_sent = 1;
        c->sent = c->args.len;
        if (!arr) arr = json_array();
        json_array_append_new(arr, d);
    }
    return arr;
}

int tc_n_calls(const tc_parser *p) { return p->n_calls; }

json_t *tc_calls_json(const tc_parser *p) {
    json_t *arr = json_array();
    for (int i = 0; i < p->n_calls; i++) {
        const tc_call *c = &p->calls[i];
        json_array_append_new(arr, json_pack("{s:s, s:s, s:{s:s, s:s%}}", "id", c->id, "type", "function",
                                             "function", "name", c->name, "arguments",
                                             c->args.p ? c->args.p : "", c->args.len));
    }
    return arr;
}

/* ---- forced calls ----------------------------------------------------------------------------- */

static json_t *tool_params(json_t *tool) {
    json_t *p = json_object_get(json_object_get(tool, "function"), "parameters");
    return json_is_object(p) ? json_incref(p) : json_pack("{s:s}", "type", "object");
}

char *tc_forced_schema(json_t *tools, const char *name, int max_calls) {
    json_t *alts = json_array(), *schema = NULL;
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (!n) continue;
        if (name) {
            if (!strcmp(n, name)) {
                schema = tool_params(t);
                break;
            }
            continue;
        }
        json_array_append_new(alts, json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s, s], s:b}", "type", "object", "properties",
                                              "name", "const", n, "parameters", tool_params(t), "required", "name",
                                              "parameters", "additionalProperties", 0));
    }
    if (!name && json_array_size(alts)) {
        schema = json_pack("{s:s, s:{s:O}, s:i}", "type", "array", "items", "anyOf", alts, "minItems", 1);
        if (max_calls > 0) json_object_set_new(schema, "maxItems", json_integer(max_calls));
    }
    json_decref(alts);
    char *s = schema ? json_dumps(schema, JSON_COMPACT) : NULL;
    json_decref(schema);
    return s;
}
