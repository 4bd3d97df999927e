/* Tokenizer loader for HF tokenizer.json (+ tokenizer_config.json beside it).
 * Reads the BPE model (vocab, merges as "a b" strings or [a, b] pairs, byte_fallback,
 * ignore_merges), the normalizer, pre-tokenizer and decoder steps we support (an unknown
 * step is an error naming it, never a silent difference), the added tokens, and the
 * post-processor's special tokens. The config gives bos/eos token text (strings or
 * AddedToken objects), add_bos_token / add_eos_token and the chat template. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"

#define U2581 "\xe2\x96\x81"

typedef struct {
    const char *path;
    char *err;
    size_t errlen;
} ctx;

static int fmt_err(const ctx *c, int code, const char *what, const char *name) {
    return specd_errf(c->err, c->errlen, code, "%s: %s '%s' is not supported", c->path, what,
                      name ? name : "?");
}

static const char *str_of(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static int bool_of(const json_t *o, const char *key, int dflt) {
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* {"String": s} or {"Regex": r} -> pattern text and whether it is literal. */
static const char *pattern_of(const json_t *o, int *literal) {
    const json_t *p = json_object_get(o, "pattern");
    const char *s;
    if (json_is_string(p)) {
        *literal = 1;
        return json_string_value(p);
    }
    if ((s = str_of(p, "String"))) {
        *literal = 1;
        return s;
    }
    *literal = 0;
    return str_of(p, "Regex");
}

/* ---- normalizer ---- */

static int push_norm(tok_tokenizer *t, tok_norm nm) {
    tok_norm *v = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *v);
    if (!v) return SPECD_ENOMEM;
    t->norms = v;
    t->norms[t->n_norms++] = nm;
    return 0;
}

static int load_norm(tok_tokenizer *t, const json_t *n, const ctx *c) {
    if (!n || json_is_null(n)) return 0;
    const char *ty = str_of(n, "type");
    if (!ty) return fmt_err(c, SPECD_EFORMAT, "normalizer", "(no type)");
    if (!strcmp(ty, "Sequence")) {
        size_t i;
        const json_t *x;
        json_array_foreach(json_object_get(n, "normalizers"), i, x) {
            int rc = load_norm(t, x, c);
            if (rc) return rc;
        }
        return 0;
    }
    static const struct { const char *name; int kind; } simple[] = {
        {"NFC", TOK_NORM_NFC}, {"NFD", TOK_NORM_NFD}, {"NFKC", TOK_NORM_NFKC},
        {"NFKD", TOK_NORM_NFKD}, {"Lowercase", TOK_NORM_LOWERCASE}};
    for (size_t i = 0; i < sizeof simple / sizeof simple[0]; i++)
        if (!strcmp(ty, simple[i].name)) return push_norm(t, (tok_norm){.kind = simple[i].kind});
    if (!strcmp(ty, "Prepend")) {
        const char *p = str_of(n, "prepend");
        if (!p) return fmt_err(c, SPECD_EFORMAT, "normalizer Prepend without", "prepend");
        char *a = strdup(p);
        if (!a) return SPECD_ENOMEM;
        return push_norm(t, (tok_norm){TOK_NORM_PREPEND, a, NULL, strlen(a), 0});
    }
    if (!strcmp(ty, "Replace")) {
        int lit;
        const char *p = pattern_of(n, &lit), *with = str_of(n, "content");
        if (!p || !lit || !with) return fmt_err(c, SPECD_EUNSUPPORTED, "normalizer", "Replace(Regex)");
        char *a = strdup(p), *b = strdup(with);
        if (!a || !b) {
            free(a);
            free(b);
            return SPECD_ENOMEM;
        }
        return push_norm(t, (tok_norm){TOK_NORM_REPLACE, a, b, strlen(a), strlen(b)});
    }
    return fmt_err(c, SPECD_EUNSUPPORTED, "normalizer", ty);
}

/* ---- pre-tokenizer ---- */

static const char RE_BYTELEVEL[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static tok_pre *new_pre(tok_tokenizer *t) {
    tok_pre *v = realloc(t->pres, (size_t)(t->n_pres + 1) * sizeof *v);
    if (!v) return NULL;
    t->pres = v;
    memset(&v[t->n_pres], 0, sizeof *v);
    return &v[t->n_pres++];
}

static int behavior_of(const char *b) {
    if (!b || !strcmp(b, "Isolated")) return TOK_SPLIT_ISOLATED;
    if (!strcmp(b, "Removed")) return TOK_SPLIT_REMOVED;
    if (!strcmp(b, "MergedWithPrevious")) return TOK_SPLIT_MERGED_PREV;
    if (!strcmp(b, "MergedWithNext")) return TOK_SPLIT_MERGED_NEXT;
    if (!strcmp(b, "Contiguous")) return TOK_SPLIT_CONTIGUOUS;
    return -1;
}

static int scheme_of(const json_t *n) {
    const char *s = str_of(n, "prepend_scheme");
    if (s) return !strcmp(s, "never") ? TOK_PREPEND_NEVER
                : !strcmp(s, "first") ? TOK_PREPEND_FIRST : TOK_PREPEND_ALWAYS;
    return bool_of(n, "add_prefix_space", 1) ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
}

static int split_pre(tok_tokenizer *t, const char *re, int literal, int behavior, int invert,
                     const ctx *c) {
    tok_pre *p = new_pre(t);
    if (!p) return SPECD_ENOMEM;
    p->kind = TOK_PRE_SPLIT;
    p->behavior = behavior;
    p->invert = invert;
    p->re = tok_regex_compile(re, strlen(re), literal, c->err, c->errlen);
    return p->re ? 0 : SPECD_EFORMAT;
}

static int load_pre(tok_tokenizer *t, const json_t *n, const ctx *c) {
    if (!n || json_is_null(n)) return 0;
    const char *ty = str_of(n, "type");
    if (!ty) return fmt_err(c, SPECD_EFORMAT, "pre_tokenizer", "(no type)");
    if (t->bytelevel) return fmt_err(c, SPECD_EUNSUPPORTED, "pre_tokenizer after ByteLevel", ty);
    if (!strcmp(ty, "Sequence")) {
        size_t i;
        const json_t *x;
        json_array_foreach(json_object_get(n, "pretokenizers"), i, x) {
            int rc = load_pre(t, x, c);
            if (rc) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "Split")) {
        int lit, beh = behavior_of(str_of(n, "behavior"));
        const char *re = pattern_of(n, &lit);
        if (!re || beh < 0) return fmt_err(c, SPECD_EUNSUPPORTED, "Split", str_of(n, "behavior"));
        return split_pre(t, re, lit, beh, bool_of(n, "invert", 0), c);
    }
    if (!strcmp(ty, "Digits"))
        return split_pre(t, bool_of(n, "individual_digits", 0) ? "\\p{N}" : "\\p{N}+", 0,
                         TOK_SPLIT_ISOLATED, 0, c);
    if (!strcmp(ty, "Whitespace"))   /* keep runs of word chars / of other non-space */
        return split_pre(t, "\\w+|[^\\w\\s]+", 0, TOK_SPLIT_REMOVED, 1, c);
    if (!strcmp(ty, "WhitespaceSplit")) return split_pre(t, "\\s+", 0, TOK_SPLIT_REMOVED, 0, c);
    if (!strcmp(ty, "ByteLevel")) {
        tok_pre *p = new_pre(t);
        if (!p) return SPECD_ENOMEM;
        p->kind = TOK_PRE_BYTELEVEL;
        p->behavior = TOK_SPLIT_ISOLATED;
        p->add_prefix_space = bool_of(n, "add_prefix_space", 1);
        if (bool_of(n, "use_regex", 1)) {
            p->re = tok_regex_compile(RE_BYTELEVEL, strlen(RE_BYTELEVEL), 0, c->err, c->errlen);
            if (!p->re) return SPECD_EFORMAT;
        }
        t->bytelevel = 1;
        return 0;
    }
    if (!strcmp(ty, "Metaspace")) {
        const char *r = str_of(n, "replacement");
        tok_pre *p = new_pre(t);
        if (!p) return SPECD_ENOMEM;
        p->kind = TOK_PRE_METASPACE;
        if (!r) r = U2581;
        p->repl_len = strlen(r) < sizeof p->repl ? strlen(r) : 0;
        memcpy(p->repl, r, p->repl_len);
        p->prepend_scheme = scheme_of(n);
        p->split = bool_of(n, "split", 1);
        return p->repl_len ? 0 : fmt_err(c, SPECD_EUNSUPPORTED, "Metaspace replacement", r);
    }
    return fmt_err(c, SPECD_EUNSUPPORTED, "pre_tokenizer", ty);
}

/* ---- decoder ---- */

static int set_replace(tok_tokenizer *t, const char *from, const char *to, const ctx *c) {
    if (strlen(from) >= sizeof t->dec_from || strlen(to) >= sizeof t->dec_to)
        return fmt_err(c, SPECD_EUNSUPPORTED, "decoder Replace of", from);
    t->dec_from_len = strlen(from);
    t->dec_to_len = strlen(to);
    memcpy(t->dec_from, from, t->dec_from_len);
    memcpy(t->dec_to, to, t->dec_to_len);
    return 0;
}

static int load_dec(tok_tokenizer *t, const json_t *n, const ctx *c) {
    if (!n || json_is_null(n)) return 0;
    const char *ty = str_of(n, "type");
    if (!ty) return fmt_err(c, SPECD_EFORMAT, "decoder", "(no type)");
    if (!strcmp(ty, "Sequence")) {
        size_t i;
        const json_t *x;
        json_array_foreach(json_object_get(n, "decoders"), i, x) {
            int rc = load_dec(t, x, c);
            if (rc) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "ByteLevel")) return t->dec_bytelevel = 1, 0;
    if (!strcmp(ty, "ByteFallback")) return t->dec_byte_fallback = 1, 0;
    if (!strcmp(ty, "Fuse")) return 0;
    if (!strcmp(ty, "Replace")) {
        int lit;
        const char *p = pattern_of(n, &lit), *to = str_of(n, "content");
        if (!p || !lit || !to) return fmt_err(c, SPECD_EUNSUPPORTED, "decoder", "Replace(Regex)");
        return set_replace(t, p, to, c);
    }
    if (!strcmp(ty, "Strip")) {
        const char *content = str_of(n, "content");
        json_int_t start = json_integer_value(json_object_get(n, "start"));
        json_int_t stop = json_integer_value(json_object_get(n, "stop"));
        if (!content || strcmp(content, " ") || stop != 0 || start < 0 || start > 8)
            return fmt_err(c, SPECD_EUNSUPPORTED, "decoder", "Strip (other than leading spaces)");
        t->dec_strip = TOK_STRIP_FUSED;
        t->dec_strip_n = (int)start;
        return 0;
    }
    if (!strcmp(ty, "Metaspace")) {
        const char *r = str_of(n, "replacement");
        int rc = set_replace(t, r ? r : U2581, " ", c);
        if (!rc && scheme_of(n) != TOK_PREPEND_NEVER) {
            t->dec_strip = TOK_STRIP_FIRST_TOKEN;
            t->dec_strip_n = 1;
        }
        return rc;
    }
    return fmt_err(c, SPECD_EUNSUPPORTED, "decoder", ty);
}

/* ---- model, added tokens, post-processor ---- */

static int load_vocab(tok_tokenizer *t, const json_t *model, const json_t *added,
                      const ctx *c) {
    const json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab))
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT, "%s: model.vocab missing", c->path);
    json_int_t max_id = -1;
    const char *k;
    const json_t *v;
    size_t i;
    json_object_foreach((json_t *)vocab, k, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 24))
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT, "%s: bad id for token '%s'",
                              c->path, k);
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    json_array_foreach(added, i, v) {
        json_int_t id = json_integer_value(json_object_get(v, "id"));
        if (id < 0 || id >= (1 << 24) || !str_of(v, "content"))
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT, "%s: added_tokens[%zu] invalid",
                              c->path, i);
        if (id > max_id) max_id = id;
    }
    if (tok_alloc_vocab(t, (int)max_id + 1)) return SPECD_ENOMEM;
    uint8_t *have = calloc((size_t)max_id + 1, 1);
    if (!have) return SPECD_ENOMEM;
    int rc = 0;
    json_object_foreach((json_t *)vocab, k, v) {
        int id = (int)json_integer_value(v);
        have[id] = 1;
        if ((rc = tok_set_token(t, id, k, strlen(k)))) break;
    }
    json_array_foreach(added, i, v) {
        int id = (int)json_integer_value(json_object_get(v, "id"));
        const char *s = str_of(v, "content");
        if (!rc && !have[id]) rc = tok_set_token(t, id, s, strlen(s));
    }
    if (!rc) rc = tok_index_vocab(t);
    for (int id = 0; !rc && id < t->n_vocab; id++)
        if (have[id]) tok_strmap_add(&t->vocab, (uint32_t)id);
    free(have);
    return rc;
}

static int load_merges(tok_tokenizer *t, const json_t *model, const ctx *c) {
    const json_t *m = json_object_get(model, "merges");
    size_t n = json_array_size(m), i;
    const json_t *x;
    if (tok_mergemap_init(&t->merges, n)) return SPECD_ENOMEM;
    json_array_foreach(m, i, x) {
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(x)) {
            a = json_string_value(x);
            const char *sp = strchr(a, ' ');
            if (!sp)
                return specd_errf(c->err, c->errlen, SPECD_EFORMAT, "%s: merges[%zu] has no space",
                                  c->path, i);
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = strlen(b);
        } else if (json_array_size(x) == 2 && json_is_string(json_array_get(x, 0)) &&
                   json_is_string(json_array_get(x, 1))) {
            a = json_string_value(json_array_get(x, 0));
            b = json_string_value(json_array_get(x, 1));
            al = json_string_length(json_array_get(x, 0));
            bl = json_string_length(json_array_get(x, 1));
        } else
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT, "%s: merges[%zu] malformed",
                              c->path, i);
        if (tok_add_merge(t, a, al, b, bl, (int32_t)i) == SPECD_ENOMEM) return SPECD_ENOMEM;
    }
    return 0;
}

static int load_added(tok_tokenizer *t, const json_t *added, const ctx *c) {
    size_t n = json_array_size(added), i;
    const json_t *x;
    tok_added *v = calloc(n + 1, sizeof *v);
    if (!v) return SPECD_ENOMEM;
    json_array_foreach(added, i, x) {
        const char *s = str_of(x, "content");
        v[i].id = (int32_t)json_integer_value(json_object_get(x, "id"));
        v[i].s = strdup(s);
        v[i].len = (uint32_t)strlen(s);
        v[i].lstrip = bool_of(x, "lstrip", 0);
        v[i].rstrip = bool_of(x, "rstrip", 0);
        v[i].single_word = bool_of(x, "single_word", 0);
        v[i].special = bool_of(x, "special", 0);
        if (!v[i].s) {
            for (size_t j = 0; j <= i; j++) free(v[j].s);
            free(v);
            return SPECD_ENOMEM;
        }
    }
    return tok_set_added(t, v, (int)n, c->err, c->errlen);
}

/* TemplateProcessing "single": special tokens before $A go first, after it last. */
static void load_post(tok_tokenizer *t, const json_t *p) {
    const char *ty = str_of(p, "type");
    if (!ty) return;
    if (!strcmp(ty, "Sequence")) {
        size_t i;
        const json_t *x;
        json_array_foreach(json_object_get(p, "processors"), i, x) load_post(t, x);
        return;
    }
    if (strcmp(ty, "TemplateProcessing")) return;
    const json_t *specials = json_object_get(p, "special_tokens"), *x;
    int after = 0;
    size_t i;
    t->n_prefix = t->n_suffix = 0;
    json_array_foreach(json_object_get(p, "single"), i, x) {
        if (json_object_get(x, "Sequence")) {
            after = 1;
            continue;
        }
        const char *name = str_of(json_object_get(x, "SpecialToken"), "id");
        const json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids");
        size_t j;
        const json_t *id;
        json_array_foreach(ids, j, id) {
            if (after && t->n_suffix < 4) t->suffix_ids[t->n_suffix++] = (int32_t)json_integer_value(id);
            if (!after && t->n_prefix < 4) t->prefix_ids[t->n_prefix++] = (int32_t)json_integer_value(id);
        }
    }
}

/* "<s>" or {"content": "<s>", ...} */
static const char *token_text(const json_t *cfg, const char *key) {
    const json_t *v = json_object_get(cfg, key);
    return json_is_string(v) ? json_string_value(v) : str_of(v, "content");
}

static int load_config(tok_tokenizer *t, const char *path, int have_template, char *err,
                       size_t errlen) {
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL | JSON_ALLOW_NUL, &je);
    if (!cfg)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s:%d: %s", path, je.line, je.text);
    int rc = SPECD_ENOMEM;
    const char *bos = token_text(cfg, "bos_token"), *eos = token_text(cfg, "eos_token");
    if (bos && !(t->bos_str = strdup(bos))) goto out;
    if (eos && !(t->eos_str = strdup(eos))) goto out;
    if (bos) t->bos_id = tok_token_id(t, bos, strlen(bos));
    const char *pad = token_text(cfg, "pad_token");
    if (pad) t->pad_id = tok_token_id(t, pad, strlen(pad));
    if (eos) t->eos_id = tok_token_id(t, eos, strlen(eos));
    const json_t *ct = json_object_get(cfg, "chat_template"), *x;
    size_t i;
    const char *tmpl = json_is_string(ct) ? json_string_value(ct) : NULL;
    json_array_foreach(ct, i, x)   /* a list of named templates: take "default" */
        if (str_of(x, "name") && !strcmp(str_of(x, "name"), "default")) tmpl = str_of(x, "template");
    if (tmpl && !(t->chat_template = strdup(tmpl))) goto out;
    /* Without a TemplateProcessing the config's flags decide. transformers' Llama/Gemma
     * fast tokenizers also rebuild the template from these flags, so there they win. */
    const char *cls = str_of(cfg, "tokenizer_class");
    int rebuild = cls && (!strncmp(cls, "Llama", 5) || !strncmp(cls, "CodeLlama", 9) ||
                          !strncmp(cls, "Gemma", 5));
    if (!have_template || rebuild) {
        int bos_flag = bool_of(cfg, "add_bos_token", rebuild ? 1 : 0);
        int eos_flag = bool_of(cfg, "add_eos_token", 0);
        t->n_prefix = t->n_suffix = 0;
        if (bos_flag && t->bos_id >= 0) t->prefix_ids[t->n_prefix++] = t->bos_id;
        if (eos_flag && t->eos_id >= 0) t->suffix_ids[t->n_suffix++] = t->eos_id;
    }
    rc = 0;
out:
    json_decref(cfg);
    return rc ? specd_errf(err, errlen, rc, "%s: out of memory", path) : 0;
}

int tok_load_json(tok_tokenizer *t, const char *json_path, const char *config_path,
                  char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(json_path, JSON_ALLOW_NUL, &je);
    if (!root)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s:%d: %s", json_path, je.line, je.text);
    ctx c = {json_path, err, errlen};
    int rc;
    const json_t *model = json_object_get(root, "model");
    const json_t *added = json_object_get(root, "added_tokens");
    const char *mty = str_of(model, "type");
    if (!mty || strcmp(mty, "BPE")) {
        rc = fmt_err(&c, SPECD_EUNSUPPORTED, "model type", mty ? mty : "(none)");
        goto out;
    }
    const char *pfx = str_of(model, "continuing_subword_prefix");
    const char *sfx = str_of(model, "end_of_word_suffix");
    if ((pfx && *pfx) || (sfx && *sfx)) {
        rc = fmt_err(&c, SPECD_EUNSUPPORTED, "BPE option", "continuing_subword_prefix/end_of_word_suffix");
        goto out;
    }
    if ((rc = load_vocab(t, model, added, &c))) goto out;
    if ((rc = load_merges(t, model, &c))) goto out;
    t->byte_fallback = bool_of(model, "byte_fallback", 0);
    t->ignore_merges = bool_of(model, "ignore_merges", 0);
    t->fuse_unk = bool_of(model, "fuse_unk", 0);
    const char *unk = str_of(model, "unk_token");
    if (unk) t->unk_id = tok_strmap_get(&t->vocab, unk, strlen(unk));
    if ((rc = load_norm(t, json_object_get(root, "normalizer"), &c))) goto out;
    if ((rc = load_pre(t, json_object_get(root, "pre_tokenizer"), &c))) goto out;
    if ((rc = load_dec(t, json_object_get(root, "decoder"), &c))) goto out;
    if ((rc = load_added(t, added, &c))) goto out;
    load_post(t, json_object_get(root, "post_processor"));
    int have_template = t->n_prefix + t->n_suffix > 0;
    if (have_template && t->n_prefix) t->bos_id = t->prefix_ids[0];
    if (config_path && (rc = load_config(t, config_path, have_template, err, errlen))) goto out;
    rc = tok_finish(t, err, errlen);
out:
    if (rc == SPECD_ENOMEM) specd_errf(err, errlen, rc, "%s: out of memory", json_path);
    json_decref(root);
    return rc;
}
