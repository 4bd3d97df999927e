/* Text side of the tokenizer: UTF-8 checks and lossy conversion, GPT-2's byte <-> char
 * map, the normalizer steps (NFC & co. through utf8proc) and the pre-tokenizer steps
 * (Split / ByteLevel / Metaspace; regexes run by PCRE2 in UTF + UCP mode, never
 * hand-written Unicode classes). Semantics follow HF tokenizers' Rust code. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"

/* ---- tok_buf ---- */

int tok_buf_reserve(tok_buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return SPECD_ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

int tok_buf_put(tok_buf *b, const void *s, size_t n) {
    if (tok_buf_reserve(b, n)) return SPECD_ENOMEM;
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

void tok_buf_free(tok_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- GPT-2 byte-level map: printable Latin-1 bytes map to themselves, the other 68
 * bytes to U+0100.. in byte order, so every byte has a visible, non-space char. ---- */

static int byte_is_printable(int b) {
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

uint32_t tok_byte_cp(int b) {
    if (byte_is_printable(b)) return (uint32_t)b;
    if (b <= 32) return 256u + (uint32_t)b;            /* 0..32   -> 256..288 */
    if (b <= 160) return 289u + (uint32_t)(b - 127);   /* 127..160 -> 289..322 */
    return 323;                                         /* 173 */
}

int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable((int)cp) ? (int)cp : -1;
    if (cp <= 288) return (int)(cp - 256);
    if (cp <= 322) return (int)(cp - 289 + 127);
    if (cp == 323) return 173;
    return -1;
}

/* ---- UTF-8 ---- */

size_t tok_utf8_encode(uint32_t cp, char *o) {
    unsigned char *u = (unsigned char *)o;
    if (cp < 0x80) { u[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) {
        u[0] = (unsigned char)(0xC0 | (cp >> 6));
        u[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        u[0] = (unsigned char)(0xE0 | (cp >> 12));
        u[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    u[0] = (unsigned char)(0xF0 | (cp >> 18));
    u[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    u[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Examines the sequence at s. Returns its length when valid; otherwise 0 and sets *bad to
 * the length of the maximal invalid subpart (>= 1), or *bad = 0 when the bytes so far are
 * a valid prefix that the buffer end cut short. Ranges per Unicode table 3-7. */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t *bad) {
    unsigned c = s[0];
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    *bad = 1;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 0;
    for (size_t k = 1; k < need; k++) {
        if (k >= n) { *bad = 0; return 0; }
        unsigned x = s[k];
        if (k == 1 ? (x < lo || x > hi) : (x < 0x80 || x > 0xBF)) { *bad = k; return 0; }
    }
    return need;
}

size_t tok_utf8_valid_len(const unsigned char *s, size_t n) {
    size_t bad;
    return n ? utf8_seq(s, n, &bad) : 0;
}

size_t tok_utf8_check(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t bad, k = utf8_seq(u + i, n - i, &bad);
        if (!k) return i;
        i += k;
    }
    return n;
}

int tok_utf8_prefix_ok(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        if (u[i] < 0x80) { i++; continue; }
        size_t bad, k = utf8_seq(u + i, n - i, &bad);
        if (!k) return bad == 0;
        i += k;
    }
    return 1;
}

size_t tok_utf8_lossy(const char *s, size_t n, int hold, tok_buf *out) {
    static const char fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;   /* run: start of the pending valid stretch */
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t bad, k = utf8_seq(u + i, n - i, &bad);
        if (k) { i += k; continue; }
        if (tok_buf_put(out, s + run, i - run)) return (size_t)-1;
        if (bad == 0) {             /* truncated at the end */
            if (hold) return i;
            bad = n - i;
        }
        if (tok_buf_put(out, fffd, 3)) return (size_t)-1;
        i += bad;
        run = i;
    }
    if (tok_buf_put(out, s + run, n - run)) return (size_t)-1;
    return n;
}

/* ---- normalizers ---- */

static void tok_buf_swap(tok_buf *a, tok_buf *b) {
    tok_buf t = *a;
    *a = *b;
    *b = t;
}

static int all_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return 0;
    return 1;
}

/* NF(K)C/D through utf8proc, one non-ASCII run at a time: an ASCII char has combining
 * class 0 and is never the second char of a composition, so a run of non-ASCII chars
 * together with the one ASCII char before it (which may be the first of a composition,
 * e + U+0301) normalizes independently of the rest; ASCII itself is invariant. */
static int norm_utf8proc(tok_buf *cur, int opts, tok_buf *tmp) {
    if (all_ascii(cur->p, cur->len)) return 0;
    tmp->len = 0;
    size_t i = 0, n = cur->len;
    const unsigned char *u = (const unsigned char *)cur->p;
    while (i < n) {
        size_t a = i;
        while (i < n && u[i] < 0x80) i++;
        if (i == n) {
            if (tok_buf_put(tmp, cur->p + a, i - a)) return SPECD_ENOMEM;
            break;
        }
        size_t r = i > a ? i - 1 : i;   /* include the ASCII char before the run */
        if (tok_buf_put(tmp, cur->p + a, r - a)) return SPECD_ENOMEM;
        while (i < n && u[i] >= 0x80) i++;
        utf8proc_uint8_t *o = NULL;
        utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)cur->p + r,
                                          (utf8proc_ssize_t)(i - r), &o, opts);
        if (k < 0) return k == UTF8PROC_ERROR_NOMEM ? SPECD_ENOMEM : SPECD_EUTF8;
        int rc = tok_buf_put(tmp, o, (size_t)k);
        free(o);
        if (rc) return rc;
    }
    tok_buf_swap(cur, tmp);
    return 0;
}

static int norm_replace(tok_buf *cur, const tok_norm *nm, tok_buf *tmp) {
    if (!nm->alen) return 0;
    tmp->len = 0;
    size_t i = 0;
    const char *p;
    while (i < cur->len &&
           (p = memmem(cur->p + i, cur->len - i, nm->a, nm->alen)) != NULL) {
        size_t at = (size_t)(p - cur->p);
        if (tok_buf_put(tmp, cur->p + i, at - i) || tok_buf_put(tmp, nm->b, nm->blen))
            return SPECD_ENOMEM;
        i = at + nm->alen;
    }
    if (tok_buf_put(tmp, cur->p + i, cur->len - i)) return SPECD_ENOMEM;
    tok_buf sw = *cur;
    *cur = *tmp;
    *tmp = sw;
    return 0;
}

static int norm_lower(tok_buf *cur, tok_buf *tmp) {
    tmp->len = 0;
    size_t i = 0;
    while (i < cur->len) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)cur->p + i,
                                              (utf8proc_ssize_t)(cur->len - i), &cp);
        if (k <= 0) return SPECD_EUTF8;
        char e[4];
        size_t m = tok_utf8_encode((uint32_t)utf8proc_tolower(cp), e);
        if (tok_buf_put(tmp, e, m)) return SPECD_ENOMEM;
        i += (size_t)k;
    }
    tok_buf sw = *cur;
    *cur = *tmp;
    *tmp = sw;
    return 0;
}

int tok_normalize(const tok_tokenizer *t, const char *s, size_t n, tok_buf *out) {
    out->len = 0;
    if (tok_buf_put(out, s, n)) return SPECD_ENOMEM;
    tok_buf tmp = {0};
    int rc = 0;
    for (int i = 0; i < t->n_norms && !rc; i++) {
        const tok_norm *nm = &t->norms[i];
        switch (nm->kind) {
        case TOK_NORM_NFC: rc = norm_utf8proc(out, UTF8PROC_STABLE | UTF8PROC_COMPOSE, &tmp); break;
        case TOK_NORM_NFD: rc = norm_utf8proc(out, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE, &tmp); break;
        case TOK_NORM_NFKC:
            rc = norm_utf8proc(out, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, &tmp);
            break;
        case TOK_NORM_NFKD:
            rc = norm_utf8proc(out, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, &tmp);
            break;
        case TOK_NORM_PREPEND:   /* HF prepends only to non-empty text */
            if (out->len) {
                tmp.len = 0;
                if (tok_buf_put(&tmp, nm->a, nm->alen) || tok_buf_put(&tmp, out->p, out->len))
                    rc = SPECD_ENOMEM;
                else {
                    tok_buf sw = *out;
                    *out = tmp;
                    tmp = sw;
                }
            }
            break;
        case TOK_NORM_REPLACE: rc = norm_replace(out, nm, &tmp); break;
        case TOK_NORM_LOWERCASE: rc = norm_lower(out, &tmp); break;
        }
    }
    tok_buf_free(&tmp);
    return rc;
}

/* ---- pre-tokenizers ---- */

/* HF runs these patterns with Oniguruma, whose \s is Unicode White_Space. PCRE2's \s
 * also takes U+180E (it is in PCRE2's \h list), so \s / \S become \p{White_Space} /
 * \P{White_Space}, PCRE2's own property table, inside classes as well. */
static char *ws_pattern(const char *pat, size_t len, size_t *out_len) {
    char *o = malloc(len * 8 + 1), *w = o;
    if (!o) return NULL;
    for (size_t i = 0; i < len; i++) {
        if (pat[i] == '\\' && i + 1 < len) {
            char c = pat[++i];
            if (c == 's' || c == 'S') {
                memcpy(w, c == 's' ? "\\p{White_Space}" : "\\P{White_Space}", 15);
                w += 15;
            } else {
                *w++ = '\\';
                *w++ = c;
            }
        } else
            *w++ = pat[i];
    }
    *w = 0;
    *out_len = (size_t)(w - o);
    return o;
}

pcre2_code *tok_regex_compile(const char *pat, size_t len, int literal, char *err,
                              size_t errlen) {
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    size_t plen = len;
    char *p = literal ? NULL : ws_pattern(pat, len, &plen);
    if (!literal && !p) {
        specd_errf(err, errlen, SPECD_ENOMEM, "pre-tokenizer regex: out of memory");
        return NULL;
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)(p ? p : pat), plen, opts, &ec, &eo, NULL);
    free(p);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        specd_errf(err, errlen, SPECD_EFORMAT, "pre-tokenizer regex at offset %zu: %s",
                   (size_t)eo, (const char *)msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* falls back to the interpreter */
    return re;
}

int tok_regex_match(const pcre2_code *re, const char *s, size_t n, size_t pos,
                    pcre2_match_data *md) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
    /* the JIT's 32 KiB machine stack can run out on odd input; the interpreter keeps its
     * backtracking on the heap */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    return rc;
}

static int pieces_push(tok_pieces *p, size_t off, size_t len, int first) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        tok_piece *v = realloc(p->v, cap * sizeof *v);
        if (!v) return SPECD_ENOMEM;
        p->v = v;
        p->cap = cap;
    }
    p->v[p->n++] = (tok_piece){off, len, first};
    return 0;
}

void tok_pieces_free(tok_pieces *p) {
    free(p->v);
    memset(p, 0, sizeof *p);
}

/* One interval of a piece: a regex match or the gap between two. An empty match is an
 * interval of length 0: it cuts the text there (HF splits at a lookahead like
 * "(?=(\d{3})+(?!\d))") and yields no piece of its own. */
typedef struct { size_t s, e; int m; } span;

/* Scratch reused across the pieces of one tok_pretokenize call. */
typedef struct {
    span *v;
    size_t cap;
    tok_buf map;        /* a piece in GPT-2 mapped chars (splits after a ByteLevel step) */
    uint32_t *back;     /* mapped byte offset -> byte offset in the piece */
    size_t back_cap;
} split_scratch;

static void split_scratch_free(split_scratch *ss) {
    free(ss->v);
    tok_buf_free(&ss->map);
    free(ss->back);
}

static int span_push(split_scratch *ss, size_t *n, size_t s, size_t e, int m) {
    if (*n == ss->cap) {
        size_t cap = ss->cap ? ss->cap * 2 : 256;
        span *v = realloc(ss->v, cap * sizeof *v);
        if (!v) return SPECD_ENOMEM;
        ss->v = v;
        ss->cap = cap;
    }
    ss->v[(*n)++] = (span){s, e, m};
    return 0;
}

/* Appends the pieces HF's Split gives for `behavior` over the intervals v[0..n). While
 * here a piece holds (start, end) relative to the split piece in (off, len); the caller
 * turns them into (offset, length) and drops the empty ones. */
static int split_emit(const span *v, size_t n, int behavior, tok_pieces *out) {
    size_t base = out->n;
    int prev_match = 0;
    if (behavior == TOK_SPLIT_MERGED_NEXT) {
        /* walk backwards: a match glues onto the start of the piece after it */
        for (size_t j = n; j-- > 0;) {
            if (v[j].m && !prev_match && out->n > base) out->v[out->n - 1].off = v[j].s;
            else if (pieces_push(out, v[j].s, v[j].e, 0)) return SPECD_ENOMEM;
            prev_match = v[j].m;
        }
        for (size_t a = base, b = out->n; a + 1 < b; a++, b--) {
            tok_piece x = out->v[a];
            out->v[a] = out->v[b - 1];
            out->v[b - 1] = x;
        }
        return 0;
    }
    for (size_t j = 0; j < n; j++) {
        int m = v[j].m, glue = 0;
        if (behavior == TOK_SPLIT_REMOVED && m) continue;
        if (behavior == TOK_SPLIT_MERGED_PREV) glue = m && !prev_match;
        if (behavior == TOK_SPLIT_CONTIGUOUS) glue = m == prev_match;
        if (glue && out->n > base) out->v[out->n - 1].len = v[j].e;
        else if (pieces_push(out, v[j].s, v[j].e, 0)) return SPECD_ENOMEM;
        prev_match = m;
    }
    return 0;
}

/* The piece as HF's steps after a ByteLevel step see it: every byte as its GPT-2 mapped
 * char (so "\s" no longer matches a space, which is now U+0120, and a UTF-8 continuation
 * byte 0xB2 is the digit U+00B2). ss->back maps offsets in the mapped text back. */
static int map_piece(const char *s, size_t n, split_scratch *ss) {
    ss->map.len = 0;
    if (tok_buf_reserve(&ss->map, 2 * n)) return SPECD_ENOMEM;
    if (2 * n + 1 > ss->back_cap) {
        uint32_t *b = realloc(ss->back, (2 * n + 1) * sizeof *b);
        if (!b) return SPECD_ENOMEM;
        ss->back = b;
        ss->back_cap = 2 * n + 1;
    }
    for (size_t i = 0; i < n; i++) {
        size_t k = tok_utf8_encode(tok_byte_cp((unsigned char)s[i]), ss->map.p + ss->map.len);
        for (size_t j = 0; j < k; j++) ss->back[ss->map.len + j] = (uint32_t)i;
        ss->map.len += k;
    }
    ss->back[ss->map.len] = (uint32_t)n;
    return 0;
}

/* Runs re over buf[pc.off .. +pc.len) (over its mapped chars if `mapped`) and appends the
 * resulting pieces to out. */
static int split_piece(const tok_pre *st, const tok_buf *buf, tok_piece pc, int mapped,
                       split_scratch *ss, pcre2_match_data *md, tok_pieces *out) {
    const char *subj = buf->p + pc.off;
    size_t len = pc.len, n = 0, pos = 0, last = 0;
    if (mapped) {
        if (map_piece(subj, len, ss)) return SPECD_ENOMEM;
        subj = ss->map.p;
        len = ss->map.len;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t start_out = out->n;
    while (pos <= len) {
        int rc = tok_regex_match(st->re, subj, len, pos, md);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return rc == PCRE2_ERROR_NOMEMORY ? SPECD_ENOMEM : SPECD_EINVAL;
        size_t ms = ov[0], me = ov[1];
        if (ms > last && span_push(ss, &n, last, ms, st->invert)) return SPECD_ENOMEM;
        if (span_push(ss, &n, ms, me, !st->invert)) return SPECD_ENOMEM;
        last = pos = me;
        if (me == ms) {   /* empty match: step one char so we always progress */
            if (ms >= len) break;
            for (pos = ms + 1; pos < len && ((unsigned char)subj[pos] & 0xC0) == 0x80; pos++) {}
        }
    }
    if (last < len && span_push(ss, &n, last, len, st->invert)) return SPECD_ENOMEM;
    if (mapped)
        for (size_t j = 0; j < n; j++) {
            ss->v[j].s = ss->back[ss->v[j].s];
            ss->v[j].e = ss->back[ss->v[j].e];
        }
    if (st->behavior == TOK_SPLIT_ISOLATED) {   /* hot path: one piece per interval */
        for (size_t j = 0; j < n; j++)
            if (ss->v[j].e > ss->v[j].s &&
                pieces_push(out, pc.off + ss->v[j].s, ss->v[j].e - ss->v[j].s, 0))
                return SPECD_ENOMEM;
    } else {
        int rc = split_emit(ss->v, n, st->behavior, out);
        if (rc) return rc;
        /* split_emit stores (start, end) relative to the piece: make them absolute and
         * drop the empty ones */
        size_t k = start_out;
        for (size_t j = start_out; j < out->n; j++) {
            size_t s = out->v[j].off, e = out->v[j].len;
            if (e > s) out->v[k++] = (tok_piece){pc.off + s, e - s, 0};
        }
        out->n = k;
    }
    if (out->n > start_out && out->v[start_out].off == pc.off) out->v[start_out].first = pc.first;
    return 0;
}

/* Metaspace: spaces -> replacement, maybe a leading replacement, maybe split before each
 * replacement (HF's MergedWithNext on the replacement char). */
static int metaspace_piece(const tok_pre *st, tok_buf *buf, tok_piece pc, tok_pieces *out) {
    size_t off = buf->len;
    int pre = st->prepend_scheme == TOK_PREPEND_ALWAYS ||
              (st->prepend_scheme == TOK_PREPEND_FIRST && pc.first);
    if (pre && !(pc.len >= st->repl_len && !memcmp(buf->p + pc.off, st->repl, st->repl_len)))
        if (tok_buf_put(buf, st->repl, st->repl_len)) return SPECD_ENOMEM;
    for (size_t i = 0; i < pc.len; i++) {
        char c = buf->p[pc.off + i];
        int rc = c == ' ' ? tok_buf_put(buf, st->repl, st->repl_len) : tok_buf_put(buf, &c, 1);
        if (rc) return rc;
    }
    size_t end = buf->len;
    if (!st->split) return end > off ? pieces_push(out, off, end - off, pc.first) : 0;
    size_t s = off;
    for (size_t i = off; i + st->repl_len <= end; i++) {
        if (i > s && !memcmp(buf->p + i, st->repl, st->repl_len)) {
            if (pieces_push(out, s, i - s, s == off && pc.first)) return SPECD_ENOMEM;
            s = i;
        }
    }
    return end > s ? pieces_push(out, s, end - s, s == off && pc.first) : 0;
}

int tok_pretokenize(const tok_tokenizer *t, tok_buf *buf, int first, tok_pieces *out,
                    pcre2_match_data *md) {
    tok_pieces a = {0}, b = {0};
    split_scratch ss = {0};
    int rc = 0, after_bytelevel = 0;
    out->n = 0;
    if (buf->len == 0) return 0;
    if (pieces_push(&a, 0, buf->len, first)) return SPECD_ENOMEM;
    for (int i = 0; i < t->n_pres && !rc; i++) {
        const tok_pre *st = &t->pres[i];
        b.n = 0;
        for (size_t j = 0; j < a.n && !rc; j++) {
            tok_piece pc = a.v[j];
            switch (st->kind) {
            case TOK_PRE_SPLIT:
                rc = split_piece(st, buf, pc, after_bytelevel, &ss, md, &b);
                break;
            case TOK_PRE_BYTELEVEL:
                if (st->add_prefix_space && pc.len && buf->p[pc.off] != ' ') {
                    size_t off = buf->len;
                    if (tok_buf_put(buf, " ", 1) || tok_buf_put(buf, buf->p + pc.off, pc.len)) {
                        rc = SPECD_ENOMEM;
                        break;
                    }
                    pc.off = off;
                    pc.len++;
                }
                rc = st->re ? split_piece(st, buf, pc, 0, &ss, md, &b)
                            : pieces_push(&b, pc.off, pc.len, pc.first);
                break;
            case TOK_PRE_METASPACE:
                rc = metaspace_piece(st, buf, pc, &b);
                break;
            }
        }
        if (st->kind == TOK_PRE_BYTELEVEL) after_bytelevel = 1;
        tok_pieces sw = a;
        a = b;
        b = sw;
    }
    split_scratch_free(&ss);
    tok_pieces_free(&b);
    if (rc) {
        tok_pieces_free(&a);
        return rc;
    }
    tok_pieces_free(out);
    *out = a;
    return 0;
}
