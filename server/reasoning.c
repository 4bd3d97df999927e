/* Reasoning sections: the incremental <think> splitter (see reasoning.h). */
#include "server/reasoning.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "server/sbuf.h"

static const char OPEN_TAG[] = "<think>", CLOSE_TAG[] = "</think>";

/* START: the output may begin with <think>; REASON: inside the section; CONTENT: after it
 * (skip_ws: still dropping the whitespace right after </think>). */
enum { R_START, R_REASON, R_CONTENT };

struct rp_parser {
    rp_mode mode;
    rp_prompt prompt;
    int st;
    int lead_ws;               /* REASON / CONTENT: whitespace here is still dropped */
    sbuf in, reason, content;
    int ended, oom;
};

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

int rp_mode_parse(const char *name, rp_mode *m) {
    if (!strcmp(name, "none")) *m = RP_NONE;
    else if (!strcmp(name, "deepseek_r1")) *m = RP_DEEPSEEK_R1;
    else if (!strcmp(name, "qwen3")) *m = RP_QWEN3;
    else return -1;
    return 0;
}

const char *rp_mode_name(rp_mode m) {
    return m == RP_DEEPSEEK_R1 ? "deepseek_r1" : m == RP_QWEN3 ? "qwen3" : "none";
}

static int ends_with(const char *s, size_t n, const char *tag) {
    size_t t = strlen(tag);
    return n >= t && !memcmp(s + n - t, tag, t);
}

rp_prompt rp_prompt_state(const char *prompt, size_t len) {
    while (len && is_ws(prompt[len - 1])) len--;
    if (ends_with(prompt, len, OPEN_TAG)) return RP_PROMPT_OPEN;
    if (ends_with(prompt, len, CLOSE_TAG)) return RP_PROMPT_CLOSED;
    return RP_PROMPT_NEUTRAL;
}

rp_parser *rp_parser_new(rp_mode mode, rp_prompt prompt) {
    if (mode == RP_NONE) return NULL;
    rp_parser *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->mode = mode;
    p->prompt = prompt;
    p->st = prompt == RP_PROMPT_CLOSED ? R_CONTENT : R_START;
    return p;
}

void rp_parser_free(rp_parser *p) {
    if (!p) return;
    free(p->in.p);
    free(p->reason.p);
    free(p->content.p);
    free(p);
}

/* Longest suffix of s[0, n) that is a proper prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag) {
    size_t t = strlen(tag);
    for (size_t k = t - 1 < n ? t - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, tag, k)) return k;
    return 0;
}

/* Consume what can be decided from in[*pos, len); returns 1 when the state changed. */
static int step(rp_parser *p, size_t *pos, int final) {
    const char *t = p->in.p + *pos;
    size_t n = p->in.len - *pos;
    if (p->st == R_START) {
        size_t lw = 0;
        while (lw < n && is_ws(t[lw])) lw++;
        size_t have = n - lw, tl = sizeof OPEN_TAG - 1;
        if (have < tl && !memcmp(t + lw, OPEN_TAG, have) && !final) return 0;   /* undecided */
        if (have >= tl && !memcmp(t + lw, OPEN_TAG, tl)) {
            *pos += lw + tl;
            p->st = R_REASON;
        } else {
            p->st = p->prompt == RP_PROMPT_OPEN || p->mode == RP_DEEPSEEK_R1 ? R_REASON : R_CONTENT;
            if (p->st == R_REASON) *pos += lw;
        }
        p->lead_ws = p->st == R_REASON;
        return 1;
    }
    if (p->lead_ws) {   /* drop whitespace at the start of either part */
        size_t lw = 0;
        while (lw < n && is_ws(t[lw])) lw++;
        *pos += lw;
        if (lw == n) return 0;
        p->lead_ws = 0;
        return 1;
    }
    if (p->st == R_CONTENT) {
        if (sbuf_add(&p->content, t, n)) p->oom = 1;
        *pos += n;
        return 0;
    }
    const char *hit = n ? memmem(t, n, CLOSE_TAG, sizeof CLOSE_TAG - 1) : NULL;
    size_t upto = hit ? (size_t)(hit - t) : final ? n : n - partial_tag(t, n, CLOSE_TAG);
    /* Whitespace before </think> (or at the very end) is dropped; until what follows it is
     * known it is held. */
    size_t keep = upto;
    while (keep && is_ws(t[keep - 1])) keep--;
    if (sbuf_add(&p->reason, t, keep)) p->oom = 1;
    if (hit) {
        *pos += upto + sizeof CLOSE_TAG - 1;
        p->st = R_CONTENT;
        p->lead_ws = 1;
        return 1;
    }
    *pos += final ? n : keep;
    return 0;
}

int rp_feed(rp_parser *p, const char *s, size_t n, int final) {
    if (p->ended) return 0;
    if (sbuf_add(&p->in, s, n)) return SPECD_ENOMEM;
    size_t pos = 0;
    while (step(p, &pos, final)) {}
    memmove(p->in.p, p->in.p + pos, p->in.len - pos);
    p->in.len -= pos;
    p->in.p[p->in.len] = 0;
    if (final) p->ended = 1;
    return p->oom ? SPECD_ENOMEM : 0;
}

void rp_take(rp_parser *p, const char **reasoning, size_t *rlen, const char **content, size_t *clen) {
    *reasoning = p->reason.p ? p->reason.p : "";
    *rlen = p->reason.len;
    *content = p->content.p ? p->content.p : "";
    *clen = p->content.len;
    p->reason.len = 0;
    p->content.len = 0;
}
