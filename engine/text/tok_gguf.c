/* Tokenizer loader for GGUF metadata (tokenizer.ggml.*). Two models:
 *  - "gpt2": byte-level BPE with merges given as "a b" strings; the pre-tokenizer regex
 *    comes from tokenizer.ggml.pre (the names llama.cpp's converter writes);
 *  - "llama": SentencePiece BPE with byte fallback; there are no merges in the file, so
 *    every split of a token into two tokens becomes a merge ranked by the token's score
 *    (highest score merges first), and the normalizer is HF's Llama one: prepend U+2581,
 *    spaces -> U+2581.
 * Token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control
 * and user-defined tokens are matched in the text before BPE (as HF's added tokens). */
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/model/gguf.h"
#include "engine/text/tok_internal.h"

/* Pre-tokenizer regexes, as in HF's tokenizer.json of each family. */
static const char RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char RE_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char RE_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static int add_split(tok_tokenizer *t, const char *re, int kind, char *err, size_t errlen) {
    tok_pre *p = &t->pres[t->n_pres];
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->behavior = TOK_SPLIT_ISOLATED;
    p->re = tok_regex_compile(re, strlen(re), 0, err, errlen);
    if (!p->re) return SPECD_EFORMAT;
    t->n_pres++;
    return 0;
}

/* Pre-tokenizer and model quirks for a byte-level vocabulary, by tokenizer.ggml.pre. */
static int setup_bpe_pre(tok_tokenizer *t, const char *pre, size_t n, const char *path,
                         char *err, size_t errlen) {
    t->pres = calloc(2, sizeof *t->pres);
    if (!t->pres) return SPECD_ENOMEM;
#define IS(s) (n == strlen(s) && !memcmp(pre, s, n))
    if (IS("llama-bpe") || IS("llama3") || IS("llama-v3") || IS("smaug-bpe") || IS("dbrx")) {
        t->ignore_merges = 1;   /* Llama-3's tokenizer.json sets ignore_merges */
        return add_split(t, RE_LLAMA3, TOK_PRE_SPLIT, err, errlen);
    }
    if (IS("qwen2") || IS("deepseek-r1-qwen")) {
        t->norms = calloc(1, sizeof *t->norms);   /* Qwen's tokenizer.json normalizes NFC */
        if (!t->norms) return SPECD_ENOMEM;
        t->norms[0].kind = TOK_NORM_NFC;
        t->n_norms = 1;
        return add_split(t, RE_QWEN2, TOK_PRE_SPLIT, err, errlen);
    }
    if (IS("gpt-2") || IS("gpt2") || IS("default"))
        return add_split(t, RE_GPT2, TOK_PRE_BYTELEVEL, err, errlen);
    if (IS("smollm")) {   /* Digits(individual) then ByteLevel */
        int rc = add_split(t, "\\p{N}", TOK_PRE_SPLIT, err, errlen);
        return rc ? rc : add_split(t, RE_GPT2, TOK_PRE_BYTELEVEL, err, errlen);
    }
#undef IS
    return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                      "%s: tokenizer.ggml.pre '%.*s' is not supported", path, (int)n, pre);
}

static int opt_id(const gguf *g, const char *key, int n_vocab) {
    int64_t v;
    if (gguf_get_i64(g, key, &v) != 0 || v < 0 || v >= n_vocab) return -1;
    return (int)v;
}

typedef struct { int id; double score; } scored;

static int score_cmp(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->id - y->id;
}

/* SentencePiece BPE: a merge (left, right) exists for every token that splits into two
 * tokens; its rank is the merged token's place in score order. */
static int spm_merges(tok_tokenizer *t, const gguf *g, const char *path, char *err,
                      size_t errlen) {
    int n = t->n_vocab;
    scored *v = malloc((size_t)n * sizeof *v);
    if (!v) return SPECD_ENOMEM;
    for (int i = 0; i < n; i++) {
        v[i].id = i;
        if (gguf_arr_f64(g, "tokenizer.ggml.scores", (uint64_t)i, &v[i].score) != 0) {
            free(v);
            return specd_errf(err, errlen, SPECD_EFORMAT,
                              "%s: tokenizer.ggml.scores missing or short", path);
        }
    }
    qsort(v, (size_t)n, sizeof *v, score_cmp);
    int rc = tok_mergemap_init(&t->merges, (size_t)n * 4);
    for (int r = 0; r < n && !rc; r++) {
        int id = v[r].id;
        const char *s = t->tok_str[id];
        size_t len = t->tok_len[id];
        for (size_t k = 1; k < len; k++) {
            if (((unsigned char)s[k] & 0xC0) == 0x80) continue;   /* char boundaries only */
            int a = tok_strmap_get(&t->vocab, s, k), b = tok_strmap_get(&t->vocab, s + k, len - k);
            if (a >= 0 && b >= 0) tok_mergemap_add(&t->merges, a, b, r, id);
        }
    }
    free(v);
    return rc;
}

static int gpt2_merges(tok_tokenizer *t, const gguf *g, const char *path, char *err,
                       size_t errlen) {
    gguf_type et;
    uint64_t n;
    if (gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n) != 0 || et != GGUF_T_STRING)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tokenizer.ggml.merges missing", path);
    int rc = tok_mergemap_init(&t->merges, (size_t)n);
    for (uint64_t i = 0; i < n && !rc; i++) {
        const char *s;
        size_t len;
        if (gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &len) != 0) return SPECD_EFORMAT;
        const char *sp = memchr(s, ' ', len);
        if (!sp)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: merge %llu has no space", path,
                              (unsigned long long)i);
        int r = tok_add_merge(t, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp - s) - 1,
                              (int32_t)i);
        if (r == SPECD_ENOMEM) rc = r;   /* a merge of unknown tokens is skipped, as HF */
    }
    return rc;
}

/* Control and user-defined tokens become added tokens matched in raw text. */
static int gguf_added(tok_tokenizer *t, const gguf *g, char *err, size_t errlen) {
    int n = t->n_vocab, k = 0;
    tok_added *v = calloc((size_t)n + 1, sizeof *v);
    if (!v) return SPECD_ENOMEM;
    for (int i = 0; i < n; i++) {
        int64_t ty = 1;
        gguf_arr_i64(g, "tokenizer.ggml.token_type", (uint64_t)i, &ty);
        if (ty != 2 && ty != 3 && ty != 4) continue;
        if (ty != 4) t->is_special[i] = 1;
        if (ty == 2) continue;   /* <unk> is special but HF does not match it in text */
        tok_added *a = &v[k];
        a->id = i;
        a->special = ty == 3;
        /* byte-level user-defined tokens are stored in mapped form: match their bytes */
        const char *s = t->tok_str[i];
        size_t len = t->tok_len[i];
        a->s = malloc(len + 1);
        if (!a->s) break;
        memcpy(a->s, s, len);
        a->s[len] = 0;
        a->len = (uint32_t)len;
        k++;
    }
    return tok_set_added(t, v, k, err, errlen);
}

int tok_load_gguf(tok_tokenizer *t, const char *path, char *err, size_t errlen) {
    gguf *g = gguf_open(path, err, errlen);
    if (!g) return SPECD_EFORMAT;
    int rc = SPECD_EFORMAT;
    const char *model, *pre = "default";
    size_t model_len, pre_len = 7;
    gguf_type et;
    uint64_t n;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) != 0) {
        specd_errf(err, errlen, SPECD_EFORMAT, "%s: no tokenizer.ggml.model", path);
        goto fail;
    }
    gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len);
    if (gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) != 0 || et != GGUF_T_STRING ||
        n == 0 || n > (1u << 24)) {
        specd_errf(err, errlen, SPECD_EFORMAT, "%s: tokenizer.ggml.tokens missing", path);
        goto fail;
    }
    if ((rc = tok_alloc_vocab(t, (int)n))) goto nomem;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if (gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len) != 0) {
            rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: token %llu unreadable", path,
                            (unsigned long long)i);
            goto fail;
        }
        if ((rc = tok_set_token(t, (int)i, s, len))) goto nomem;
    }
    if ((rc = tok_index_vocab(t))) goto nomem;
    for (int i = 0; i < t->n_vocab; i++) tok_strmap_add(&t->vocab, (uint32_t)i);
    t->unk_id = opt_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab);
    t->bos_id = opt_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos_id = opt_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    t->pad_id = opt_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab);
    if (model_len == 4 && !memcmp(model, "gpt2", 4)) {
        t->bytelevel = t->dec_bytelevel = 1;
        if ((rc = setup_bpe_pre(t, pre, pre_len, path, err, errlen))) goto fail;
        if ((rc = gpt2_merges(t, g, path, err, errlen))) goto fail;
    } else if (model_len == 5 && !memcmp(model, "llama", 5)) {
        t->byte_fallback = t->dec_byte_fallback = 1;
        int prefix = 1;   /* add_space_prefix = false: no leading U+2581 */
        gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &prefix);
        t->norms = calloc(2, sizeof *t->norms);
        if (!t->norms) goto nomem;
        if (prefix)
            t->norms[t->n_norms++] =
                (tok_norm){TOK_NORM_PREPEND, strdup("\xe2\x96\x81"), NULL, 3, 0};
        t->norms[t->n_norms++] =
            (tok_norm){TOK_NORM_REPLACE, strdup(" "), strdup("\xe2\x96\x81"), 1, 3};
        for (int i = 0; i < t->n_norms; i++)
            if (!t->norms[i].a || (t->norms[i].kind == TOK_NORM_REPLACE && !t->norms[i].b))
                goto nomem;
        memcpy(t->dec_from, "\xe2\x96\x81", 3);
        t->dec_from_len = 3;
        t->dec_to[0] = ' ';
        t->dec_to_len = 1;
        t->dec_strip = TOK_STRIP_FUSED;
        t->dec_strip_n = prefix;
        if ((rc = spm_merges(t, g, path, err, errlen))) goto fail;
    } else {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                        "%s: tokenizer.ggml.model '%.*s' is not supported (gpt2, llama)", path,
                        (int)model_len, model);
        goto fail;
    }
    if ((rc = gguf_added(t, g, err, errlen))) goto fail;
    int add_bos = 0, add_eos = 0;
    if (gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos) != 0)
        add_bos = !t->bytelevel;   /* llama.cpp's default: SentencePiece models add BOS */
    gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &add_eos);
    if (add_bos && t->bos_id >= 0) t->prefix_ids[t->n_prefix++] = t->bos_id;
    if (add_eos && t->eos_id >= 0) t->suffix_ids[t->n_suffix++] = t->eos_id;
    const char *tmpl;
    size_t tlen;
    if (gguf_get_str(g, "tokenizer.chat_template", &tmpl, &tlen) == 0) {
        t->chat_template = malloc(tlen + 1);
        if (!t->chat_template) goto nomem;
        memcpy(t->chat_template, tmpl, tlen);
        t->chat_template[tlen] = 0;
    }
    rc = tok_finish(t, err, errlen);
    gguf_close(g);
    return rc;
nomem:
    rc = specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
fail:
    gguf_close(g);
    return rc;
}
