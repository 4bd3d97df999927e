/* Tokenizer front (tokenizer.h): loading dispatch, the encode pipeline (added tokens ->
 * normalizer -> pre-tokenizer -> BPE), decode and the streaming detokenizer.
 *
 * Decode is written once, as the stream: every id becomes a byte piece; runs of <0xNN>
 * tokens (byte fallback) are valid UTF-8 as a whole or become one U+FFFD per byte, as
 * HF's ByteFallback decoder does; the joined bytes go through a lossy UTF-8 conversion
 * that holds back a sequence cut short; the Strip / Metaspace rules drop leading spaces.
 * tok_decode() is the stream run to the end, so pieces always add up to the full text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"

#define U2581 "\xe2\x96\x81"

/* ---- building (used by the loaders) ---- */

int tok_alloc_vocab(tok_tokenizer *t, int n) {
    t->n_vocab = n;
    t->tok_off = calloc((size_t)n + 1, sizeof *t->tok_off);
    t->tok_len = calloc((size_t)n + 1, sizeof *t->tok_len);
    t->is_special = calloc((size_t)n + 1, 1);
    if (!t->tok_off || !t->tok_len || !t->is_special) return SPECD_ENOMEM;
    return tok_buf_reserve(&t->str_blob, 1);
}

int tok_set_token(tok_tokenizer *t, int id, const char *s, size_t len) {
    if (id < 0 || id >= t->n_vocab) return SPECD_ERANGE;
    t->tok_off[id] = (uint32_t)t->str_blob.len;
    t->tok_len[id] = (uint32_t)len;
    if (tok_buf_put(&t->str_blob, s, len)) return SPECD_ENOMEM;
    return tok_buf_put(&t->str_blob, "", 1);   /* keep every token NUL-terminated */
}

int tok_index_vocab(tok_tokenizer *t) {
    t->tok_str = calloc((size_t)t->n_vocab + 1, sizeof *t->tok_str);
    if (!t->tok_str) return SPECD_ENOMEM;
    for (int i = 0; i < t->n_vocab; i++)
        t->tok_str[i] = t->tok_len[i] ? t->str_blob.p + t->tok_off[i] : "";
    return tok_strmap_init(&t->vocab, (size_t)t->n_vocab, t->tok_str, t->tok_len);
}

static int added_cmp(const void *a, const void *b) {
    const tok_added *x = a, *y = b;
    unsigned char cx = (unsigned char)x->s[0], cy = (unsigned char)y->s[0];
    if (cx != cy) return cx < cy ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;   /* longest first */
    return x->id < y->id ? -1 : x->id > y->id;
}

int tok_set_added(tok_tokenizer *t, tok_added *v, int n, char *err, size_t errlen) {
    int k = 0;
    for (int i = 0; i < n; i++) {   /* drop empty ones: they would match everywhere */
        if (v[i].len && v[i].id >= 0 && v[i].id < t->n_vocab) v[k++] = v[i];
        else free(v[i].s);
    }
    if (k > 32000) {
        for (int i = 0; i < k; i++) free(v[i].s);
        free(v);
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "too many added tokens (%d)", k);
    }
    qsort(v, (size_t)k, sizeof *v, added_cmp);
    t->added = v;
    t->n_added = k;
    for (int b = 0; b < 256; b++) t->added_first[b] = -1;
    for (int i = k - 1; i >= 0; i--) t->added_first[(unsigned char)v[i].s[0]] = (int16_t)i;
    for (int i = 0; i < k; i++)
        if (v[i].special) t->is_special[v[i].id] = 1;
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* The piece one token decodes to, before joining (HF decoders applied per token). */
static int decode_piece(tok_tokenizer *t, int id, tok_buf *blob) {
    const char *s = t->tok_str[id];
    size_t n = t->tok_len[id];
    t->piece_off[id] = (uint32_t)blob->len;
    t->piece_byte[id] = -1;
    if (t->dec_byte_fallback && n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' &&
        hexval(s[3]) >= 0 && hexval(s[4]) >= 0)
        t->piece_byte[id] = (int16_t)(hexval(s[3]) * 16 + hexval(s[4]));
    if (t->dec_bytelevel) {
        /* HF ByteLevel: map every char back to its byte; a token with any char outside
         * the map (an added token with a space, say) is taken as raw UTF-8 instead. */
        size_t start = blob->len;
        for (size_t i = 0; i < n;) {
            size_t cl = tok_utf8_valid_len((const unsigned char *)s + i, n - i);
            int b = -1;
            if (cl) {
                uint32_t cp = (unsigned char)s[i];
                if (cl > 1) cp &= 0xFFu >> (cl + 1);
                for (size_t j = 1; j < cl; j++) cp = (cp << 6) | ((unsigned char)s[i + j] & 0x3F);
                b = tok_cp_to_byte(cp);
            }
            if (b < 0) {
                blob->len = start;
                if (tok_buf_put(blob, s, n)) return SPECD_ENOMEM;
                break;
            }
            char c = (char)b;
            if (tok_buf_put(blob, &c, 1)) return SPECD_ENOMEM;
            i += cl;
        }
    } else if (t->dec_from_len) {
        const char *p;
        size_t i = 0;
        while (i < n && (p = memmem(s + i, n - i, t->dec_from, t->dec_from_len)) != NULL) {
            if (tok_buf_put(blob, s + i, (size_t)(p - s) - i) ||
                tok_buf_put(blob, t->dec_to, t->dec_to_len))
                return SPECD_ENOMEM;
            i = (size_t)(p - s) + t->dec_from_len;
        }
        if (tok_buf_put(blob, s + i, n - i)) return SPECD_ENOMEM;
    } else if (tok_buf_put(blob, s, n))
        return SPECD_ENOMEM;
    t->piece_len[id] = (uint32_t)(blob->len - t->piece_off[id]);
    return 0;
}

static char *dup_str(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

int tok_finish(tok_tokenizer *t, char *err, size_t errlen) {
    /* initial symbols for bytes: the mapped char (byte-level) or <0xNN> (byte fallback) */
    for (int b = 0; b < 256; b++) {
        char key[8];
        size_t n;
        if (t->bytelevel) n = tok_utf8_encode(tok_byte_cp(b), key);
        else n = (size_t)snprintf(key, sizeof key, "<0x%02X>", b);
        /* Some byte-level vocabularies (SmolLM2) lack a few control bytes; HF's BPE then
         * maps such a byte to the unk token or drops it, and so does initial_symbols(). */
        t->byte_sym[b] = tok_strmap_get(&t->vocab, key, n);
    }
    /* SentencePiece words: safe to encode one U+2581-started word at a time when no
     * token has U+2581 right after some other char (then no merge crosses such a cut) */
    t->spm_split = !t->bytelevel;
    for (int i = 0; i < t->n_vocab && t->spm_split; i++) {
        const char *s = t->tok_str[i];
        size_t n = t->tok_len[i];
        for (size_t j = 1; j + 3 <= n; j++)
            if (!memcmp(s + j, U2581, 3) && (j < 3 || memcmp(s + j - 3, U2581, 3))) {
                t->spm_split = 0;
                break;
            }
    }
    int live = 0, seen_bytelevel = 0, mapped = 0;   /* mapped: a ByteLevel step before it */
    const tok_pre *only = NULL;
    for (int i = 0; i < t->n_pres; i++) {
        const tok_pre *p = &t->pres[i];
        if (p->kind == TOK_PRE_BYTELEVEL && !p->re && !p->add_prefix_space) {
            seen_bytelevel = 1;
            continue;
        }
        live++;
        only = p;
        mapped = seen_bytelevel;
    }
    t->fast_none = live == 0;
    if (live == 1 && only->re && only->behavior == TOK_SPLIT_ISOLATED && !only->invert &&
        !mapped && !(only->kind == TOK_PRE_BYTELEVEL && only->add_prefix_space))
        t->fast_re = only->re;
    tok_buf blob = {0};
    t->piece_off = calloc((size_t)t->n_vocab + 1, sizeof *t->piece_off);
    t->piece_len = calloc((size_t)t->n_vocab + 1, sizeof *t->piece_len);
    t->piece_byte = calloc((size_t)t->n_vocab + 1, sizeof *t->piece_byte);
    if (!t->piece_off || !t->piece_len || !t->piece_byte) goto nomem;
    for (int i = 0; i < t->n_vocab; i++)
        if (decode_piece(t, i, &blob)) goto nomem;
    if (tok_buf_reserve(&blob, 1)) goto nomem;
    t->piece_blob = blob.p;
    uint8_t *in_model = calloc((size_t)t->n_vocab + 1, 1);
    if (!in_model) return specd_errf(err, errlen, SPECD_ENOMEM, "tokenizer: out of memory");
    for (int i = 0; i < t->n_vocab; i++)
        in_model[i] = t->tok_len[i] && tok_strmap_get(&t->vocab, t->tok_str[i], t->tok_len[i]) == i;
    int rc = tok_build_direct(t, in_model);
    free(in_model);
    if (rc) return specd_errf(err, errlen, rc, "tokenizer: %s", specd_strerror(rc));
    if (!t->bos_str) {
        t->bos_str = t->bos_id >= 0 ? dup_str(t->tok_str[t->bos_id], t->tok_len[t->bos_id])
                                    : dup_str("", 0);
    }
    if (!t->eos_str) {
        t->eos_str = t->eos_id >= 0 ? dup_str(t->tok_str[t->eos_id], t->tok_len[t->eos_id])
                                    : dup_str("", 0);
    }
    if (!t->bos_str || !t->eos_str) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    return 0;
nomem:
    tok_buf_free(&blob);
    return specd_errf(err, errlen, SPECD_ENOMEM, "tokenizer: out of memory");
}

/* ---- load / free ---- */

static int ends_with(const char *s, const char *suf) {
    size_t n = strlen(s), m = strlen(suf);
    return n >= m && !strcmp(s + n - m, suf);
}

static int file_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

tok_tokenizer *tok_load(const char *path, char *err, size_t errlen) {
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        specd_errf(err, errlen, SPECD_EIO, "%s: no such file or directory",
                   path ? path : "(null)");
        return NULL;
    }
    tok_tokenizer *t = calloc(1, sizeof *t);
    char *json = NULL, *cfg = NULL;
    int rc;
    if (!t) goto nomem;
    t->unk_id = t->bos_id = t->eos_id = t->pad_id = -1;
    for (int b = 0; b < 256; b++) t->added_first[b] = -1;
    size_t n = strlen(path);
    if (S_ISDIR(st.st_mode)) {
        json = malloc(n + 32);
        cfg = malloc(n + 32);
        if (!json || !cfg) goto nomem;
        snprintf(json, n + 32, "%s/tokenizer.json", path);
        snprintf(cfg, n + 32, "%s/tokenizer_config.json", path);
        if (!file_exists(json)) {
            specd_errf(err, errlen, SPECD_ENOTFOUND, "%s: no tokenizer.json in checkpoint", path);
            goto fail;
        }
        rc = tok_load_json(t, json, file_exists(cfg) ? cfg : NULL, err, errlen);
    } else if (ends_with(path, ".gguf")) {
        rc = tok_load_gguf(t, path, err, errlen);
    } else {
        cfg = malloc(n + 32);
        if (!cfg) goto nomem;
        memcpy(cfg, path, n + 1);
        char *slash = strrchr(cfg, '/');
        if (slash) strcpy(slash + 1, "tokenizer_config.json");
        else strcpy(cfg, "tokenizer_config.json");
        rc = tok_load_json(t, path, file_exists(cfg) ? cfg : NULL, err, errlen);
    }
    if (rc) goto fail;
    free(json);
    free(cfg);
    return t;
nomem:
    specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
fail:
    free(json);
    free(cfg);
    tok_free(t);
    return NULL;
}

void tok_free(tok_tokenizer *t) {
    if (!t) return;
    free(t->tok_str);
    free(t->tok_len);
    free(t->tok_off);
    free(t->is_special);
    tok_buf_free(&t->str_blob);
    tok_strmap_free(&t->vocab);
    tok_strmap_free(&t->direct);
    free(t->direct_key);
    tok_mergemap_free(&t->merges);
    for (int i = 0; i < t->n_norms; i++) {
        free(t->norms[i].a);
        free(t->norms[i].b);
    }
    free(t->norms);
    for (int i = 0; i < t->n_pres; i++) pcre2_code_free(t->pres[i].re);
    free(t->pres);
    for (int i = 0; i < t->n_added; i++) free(t->added[i].s);
    free(t->added);
    free(t->bos_str);
    free(t->eos_str);
    free(t->chat_template);
    free(t->piece_blob);
    free(t->piece_off);
    free(t->piece_len);
    free(t->piece_byte);
    free(t);
}

/* ---- accessors ---- */

int tok_vocab_size(const tok_tokenizer *t) { return t->n_vocab; }
int tok_bos_id(const tok_tokenizer *t) { return t->bos_id; }
int tok_eos_id(const tok_tokenizer *t) { return t->eos_id; }
int tok_pad_id(const tok_tokenizer *t) { return t->pad_id; }
const char *tok_bos_token(const tok_tokenizer *t) { return t->bos_str ? t->bos_str : ""; }
const char *tok_eos_token(const tok_tokenizer *t) { return t->eos_str ? t->eos_str : ""; }
const char *tok_chat_template(const tok_tokenizer *t) { return t->chat_template; }

int tok_add_bos(const tok_tokenizer *t) {
    return t->bos_id >= 0 && t->n_prefix > 0 && t->prefix_ids[0] == t->bos_id;
}

int tok_token_id(const tok_tokenizer *t, const char *s, size_t len) {
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == len && !memcmp(t->added[i].s, s, len)) return t->added[i].id;
    return tok_strmap_get(&t->vocab, s, len);
}

int tok_is_special(const tok_tokenizer *t, int id) {
    return id >= 0 && id < t->n_vocab && t->is_special[id];
}

int tok_token_bytes(const tok_tokenizer *t, int id, const char **bytes, size_t *len) {
    static const unsigned char all_bytes[256] = {
#define B4(i) i, i + 1, i + 2, i + 3
#define B16(i) B4(i), B4(i + 4), B4(i + 8), B4(i + 12)
#define B64(i) B16(i), B16(i + 16), B16(i + 32), B16(i + 48)
        B64(0), B64(64), B64(128), B64(192)
#undef B64
#undef B16
#undef B4
    };
    if (id < 0 || id >= t->n_vocab) return SPECD_EINVAL;
    if (t->piece_byte[id] >= 0) {
        *bytes = (const char *)all_bytes + t->piece_byte[id];
        *len = 1;
    } else {
        *bytes = t->piece_blob + t->piece_off[id];
        *len = t->piece_len[id];
    }
    return 0;
}

/* ---- encode ---- */

typedef struct {
    tok_buf norm;
    tok_pieces pieces;
    tok_bpe_scratch *bpe;
    pcre2_match_data *md;
} enc_state;

/* BPE of one pre-token; SentencePiece text is cut before every U+2581 that follows
 * another char when the vocabulary makes that safe (t->spm_split). */
static int encode_piece(const tok_tokenizer *t, const char *p, size_t len, enc_state *st,
                        tok_ids *out) {
    size_t s0 = 0;
    if (t->spm_split)
        for (size_t j = 1; j + 3 <= len; j++)
            if (!memcmp(p + j, U2581, 3) && (j < 3 || memcmp(p + j - 3, U2581, 3))) {
                int rc = tok_bpe_piece_cached(t, p + s0, j - s0, st->bpe, out);
                if (rc) return rc;
                s0 = j;
                j += 2;
            }
    return tok_bpe_piece_cached(t, p + s0, len - s0, st->bpe, out);
}

/* The common pre-tokenizer, one regex with Isolated behavior, run inline: matches and the
 * gaps between them are pieces. */
static int encode_fast(const tok_tokenizer *t, const char *s, size_t n, enc_state *st,
                       tok_ids *out) {
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->md);
    size_t pos = 0, last = 0;
    int rc = 0;
    while (pos <= n && !rc) {
        int m = tok_regex_match(t->fast_re, s, n, pos, st->md);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) return m == PCRE2_ERROR_NOMEMORY ? SPECD_ENOMEM : SPECD_EINVAL;
        size_t ms = ov[0], me = ov[1];
        if (ms > last) rc = encode_piece(t, s + last, ms - last, st, out);
        if (!rc && me > ms) rc = encode_piece(t, s + ms, me - ms, st, out);
        last = pos = me;
        if (me == ms) {   /* an empty match cuts the text there; step one char */
            if (ms >= n) break;
            for (pos = ms + 1; pos < n && ((unsigned char)s[pos] & 0xC0) == 0x80; pos++) {}
        }
    }
    if (!rc && last < n) rc = encode_piece(t, s + last, n - last, st, out);
    return rc;
}

/* A text segment with no added token in it: normalize, pre-tokenize, BPE each piece. */
static int encode_segment(const tok_tokenizer *t, const char *s, size_t n, int first,
                          enc_state *st, tok_ids *out) {
    if (!n) return 0;
    const char *p = s;
    size_t len = n;
    if (t->n_norms) {
        int rc = tok_normalize(t, s, n, &st->norm);
        if (rc) return rc;
        p = st->norm.p;
        len = st->norm.len;
    }
    if (t->fast_none) return encode_piece(t, p, len, st, out);
    if (t->fast_re) return encode_fast(t, p, len, st, out);
    if (!t->n_norms) {   /* the pre-tokenizer may append rewritten text: work on a copy */
        st->norm.len = 0;
        if (tok_buf_put(&st->norm, s, n)) return SPECD_ENOMEM;
    }
    int rc = tok_pretokenize(t, &st->norm, first, &st->pieces, st->md);
    for (size_t i = 0; i < st->pieces.n && !rc; i++)
        rc = encode_piece(t, st->norm.p + st->pieces.v[i].off, st->pieces.v[i].len, st, out);
    return rc;
}

static int is_ws(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static int is_word_byte(unsigned char c) {
    return c >= 0x80 || c == '_' || (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
}

/* Leftmost-longest added token at or after `from`: returns its index or -1; *at set. */
static int find_added(const tok_tokenizer *t, const char *s, size_t n, size_t from, size_t *at) {
    for (size_t i = from; i < n; i++) {
        int g = t->added_first[(unsigned char)s[i]];
        if (g < 0) continue;
        for (int k = g; k < t->n_added && t->added[k].s[0] == s[i]; k++) {
            const tok_added *a = &t->added[k];
            if (a->len > n - i || memcmp(s + i, a->s, a->len)) continue;
            if (a->single_word && ((i > 0 && is_word_byte((unsigned char)s[i - 1])) ||
                                   (i + a->len < n && is_word_byte((unsigned char)s[i + a->len]))))
                continue;
            *at = i;
            return k;
        }
    }
    return -1;
}

int tok_encode(const tok_tokenizer *t, const char *text, size_t len, int add_special,
               int32_t **ids, char *err, size_t errlen) {
    *ids = NULL;
    if (!text && len) return specd_errf(err, errlen, SPECD_EINVAL, "tok_encode: NULL text");
    size_t bad = tok_utf8_check(text, len);
    if (bad < len)
        return specd_errf(err, errlen, SPECD_EUTF8, "invalid UTF-8 at byte offset %zu", bad);
    tok_ids out = {0};
    enc_state st = {0};
    int rc = 0;
    st.bpe = tok_bpe_scratch_new(len >= 16384);   /* the cache costs more than it saves on short text */
    st.md = pcre2_match_data_create(1, NULL);
    if (!st.bpe || !st.md) goto nomem;
    if (add_special)
        for (int i = 0; i < t->n_prefix; i++)
            if (tok_ids_push(&out, t->prefix_ids[i])) goto nomem;
    size_t seg = 0, pos = 0, at;
    int k;
    while (t->n_added && (k = find_added(t, text, len, pos, &at)) >= 0) {
        const tok_added *a = &t->added[k];
        size_t end = at, next = at + a->len;
        if (a->lstrip)
            while (end > seg && is_ws((unsigned char)text[end - 1])) end--;
        if (a->rstrip)
            while (next < len && is_ws((unsigned char)text[next])) next++;
        rc = encode_segment(t, text + seg, end - seg, seg == 0, &st, &out);
        if (rc) goto fail;
        if (tok_ids_push(&out, a->id)) goto nomem;
        seg = pos = next;
    }
    rc = encode_segment(t, text + seg, len - seg, seg == 0, &st, &out);
    if (rc) goto fail;
    if (add_special)
        for (int i = 0; i < t->n_suffix; i++)
            if (tok_ids_push(&out, t->suffix_ids[i])) goto nomem;
    tok_buf_free(&st.norm);
    tok_pieces_free(&st.pieces);
    tok_bpe_scratch_free(st.bpe);
    pcre2_match_data_free(st.md);
    if (!out.v && !(out.v = malloc(sizeof(int32_t)))) return SPECD_ENOMEM;
    *ids = out.v;
    return (int)out.n;
nomem:
    rc = SPECD_ENOMEM;
fail:
    specd_errf(err, errlen, rc, "tokenize: %s", specd_strerror(rc));
    tok_buf_free(&st.norm);
    tok_pieces_free(&st.pieces);
    tok_bpe_scratch_free(st.bpe);
    pcre2_match_data_free(st.md);
    free(out.v);
    return rc;
}

/* ---- decode / stream ---- */

struct tok_stream {
    const tok_tokenizer *t;
    int skip_special;
    tok_buf group;      /* bytes of the current run of <0xNN> tokens, undecided */
    int group_bad;      /* the run already holds an invalid sequence: all of it is U+FFFD */
    tok_buf raw;        /* joined bytes not yet converted (a UTF-8 sequence cut short) */
    tok_buf out;        /* final text not yet handed to the caller */
    long n_tokens;      /* tokens given to the decoder (for the first-token strip) */
    int strip_left;     /* leading spaces the fused Strip may still drop */
};

static const char FFFD[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Moves converted text to out, dropping leading spaces the Strip decoder removes. */
static int stream_emit(tok_stream *s, const char *p, size_t n, int final) {
    if (tok_buf_put(&s->raw, p, n)) return SPECD_ENOMEM;
    size_t before = s->out.len;
    size_t used = tok_utf8_lossy(s->raw.p, s->raw.len, !final, &s->out);
    if (used == (size_t)-1) return SPECD_ENOMEM;
    memmove(s->raw.p, s->raw.p + used, s->raw.len - used);
    s->raw.len -= used;
    while (s->strip_left > 0 && s->out.len > before) {
        if (s->out.p[before] != ' ') {
            s->strip_left = 0;
            break;
        }
        memmove(s->out.p + before, s->out.p + before + 1, s->out.len - before - 1);
        s->out.len--;
        s->strip_left--;
    }
    return 0;
}

static int group_end(tok_stream *s) {
    int rc = 0;
    if (s->group.len) {
        if (!s->group_bad && tok_utf8_check(s->group.p, s->group.len) == s->group.len)
            rc = stream_emit(s, s->group.p, s->group.len, 0);
        else
            for (size_t i = 0; i < s->group.len && !rc; i++) rc = stream_emit(s, FFFD, 3, 0);
    }
    s->group.len = 0;
    s->group_bad = 0;
    return rc;
}

static int stream_feed(tok_stream *s, int32_t id) {
    const tok_tokenizer *t = s->t;
    if (id < 0 || id >= t->n_vocab) return 0;   /* HF drops ids it has no token for */
    if (s->skip_special && t->is_special[id]) return 0;
    long idx = s->n_tokens++;
    int b = t->piece_byte[id];
    if (b >= 0) {
        if (s->group_bad) return stream_emit(s, FFFD, 3, 0);
        char c = (char)b;
        if (tok_buf_put(&s->group, &c, 1)) return SPECD_ENOMEM;
        /* once the run holds a definitely invalid sequence, the whole run is U+FFFD */
        if (!tok_utf8_prefix_ok(s->group.p, s->group.len)) {
            size_t k = s->group.len;
            s->group.len = 0;
            for (size_t i = 0; i < k; i++)
                if (stream_emit(s, FFFD, 3, 0)) return SPECD_ENOMEM;
            s->group_bad = 1;
        }
        return 0;
    }
    int rc = group_end(s);
    if (rc) return rc;
    const char *p = t->piece_blob + t->piece_off[id];
    size_t n = t->piece_len[id];
    if (t->dec_strip == TOK_STRIP_FIRST_TOKEN && idx == 0)
        for (int k = 0; k < t->dec_strip_n && n && *p == ' '; k++) p++, n--;
    return stream_emit(s, p, n, 0);
}

static int stream_finish(tok_stream *s) {
    int rc = group_end(s);
    return rc ? rc : stream_emit(s, "", 0, 1);
}

static void stream_init(tok_stream *s, const tok_tokenizer *t, int skip_special) {
    memset(s, 0, sizeof *s);
    s->t = t;
    s->skip_special = skip_special;
    s->strip_left = t->dec_strip == TOK_STRIP_FUSED ? t->dec_strip_n : 0;
}

static void stream_release(tok_stream *s) {
    tok_buf_free(&s->group);
    tok_buf_free(&s->raw);
    tok_buf_free(&s->out);
}

int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, int skip_special,
               char **text, size_t *len) {
    tok_stream s;
    stream_init(&s, t, skip_special);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) rc = stream_feed(&s, ids[i]);
    if (!rc) rc = stream_finish(&s);
    if (!rc) rc = tok_buf_reserve(&s.out, 1);
    if (rc) {
        stream_release(&s);
        return rc;
    }
    s.out.p[s.out.len] = 0;
    *text = s.out.p;
    if (len) *len = s.out.len;
    s.out.p = NULL;
    stream_release(&s);
    return 0;
}

tok_stream *tok_stream_new(const tok_tokenizer *t, int skip_special) {
    tok_stream *s = malloc(sizeof *s);
    if (s) stream_init(s, t, skip_special);
    return s;
}

void tok_stream_free(tok_stream *s) {
    if (!s) return;
    stream_release(s);
    free(s);
}

/* Hands out what is final; text that does not fit stays for the next call. */
static int deliver(tok_stream *s, char *out, size_t cap) {
    if (s->out.len > cap) return SPECD_ERANGE;
    if (s->out.len) memcpy(out, s->out.p, s->out.len);
    int n = (int)s->out.len;
    s->out.len = 0;
    return n;
}

int tok_stream_push(tok_stream *s, int32_t id, char *out, size_t cap) {
    int rc = stream_feed(s, id);
    return rc ? rc : deliver(s, out, cap);
}

int tok_stream_flush(tok_stream *s, char *out, size_t cap) {
    int rc = stream_finish(s);
    return rc ? rc : deliver(s, out, cap);
}
