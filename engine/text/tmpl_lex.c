/* Chat-template lexer: Jinja2 source -> tokens, reproducing jinja2's lexer with
 * trim_blocks=True and lstrip_blocks=True (what HF sets):
 *   - newlines are normalised to \n and one trailing newline of the source is dropped;
 *   - `{%-`/`{{-`/`{#-` strip all whitespace before the tag, `-%}`/`-}}`/`-#}` all after;
 *   - a block or comment tag alone on its line (only spaces before it) takes those
 *     spaces with it (lstrip_blocks) unless it opens with `+`;
 *   - the first newline after `%}` or `#}` is removed (trim_blocks) unless `+%}`.
 * Inside tags, `}}` / `%}` close the tag only when no bracket is open, as in jinja2. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tmpl_ast.h"

typedef struct {
    const char *s;      /* normalised source */
    size_t len, pos;
    int line;
    tk_list *out;
    char *err;
    size_t errlen;
} lexer;

static int py_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
           (c >= 0x1c && c <= 0x1f);
}

static int lex_fail(lexer *L, const char *msg) {
    return specd_errf(L->err, L->errlen, SPECD_ETEMPLATE, "TemplateSyntaxError: %s (line %d)",
                      msg, L->line);
}

static int push(lexer *L, tk_type type, const char *s, size_t len, int line) {
    tk_list *o = L->out;
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        tk_token *nt = realloc(o->t, cap * sizeof *nt);
        if (!nt) return SPECD_ENOMEM;
        o->t = nt;
        o->cap = cap;
    }
    tk_token *t = &o->t[o->n];
    memset(t, 0, sizeof *t);
    t->type = type;
    t->line = line;
    t->s = malloc(len + 1);
    if (!t->s) return SPECD_ENOMEM;
    if (len) memcpy(t->s, s, len);
    t->s[len] = 0;
    t->len = len;
    o->n++;
    return 0;
}

static void count_lines(lexer *L, size_t from, size_t to) {
    for (size_t i = from; i < to; i++)
        if (L->s[i] == '\n') L->line++;
}

/* Emit the text before a tag with that tag's left whitespace control applied. */
static int emit_text(lexer *L, size_t start, size_t end, char sign, int lstrip_ok) {
    int line = L->line;
    size_t e = end;
    if (sign == '-') {
        while (e > start && py_space((unsigned char)L->s[e - 1])) e--;
    } else if (sign != '+' && lstrip_ok) {
        size_t lp = e;
        while (lp > start && L->s[lp - 1] != '\n') lp--;
        int line_starting = start == 0 || L->s[start - 1] == '\n';
        if ((lp > start || line_starting) && lp < e) {
            size_t k = lp;
            while (k < e && py_space((unsigned char)L->s[k])) k++;
            if (k == e) e = lp;
        }
    }
    count_lines(L, start, end);
    if (e > start) return push(L, TK_TEXT, L->s + start, e - start, line);
    return 0;
}

/* After a closing tag: `-` eats all whitespace, plain block/comment ends eat one \n. */
static void after_close(lexer *L, char sign, int trim_newline) {
    if (sign == '-') {
        size_t p = L->pos;
        while (p < L->len && py_space((unsigned char)L->s[p])) p++;
        count_lines(L, L->pos, p);
        L->pos = p;
    } else if (sign != '+' && trim_newline && L->pos < L->len && L->s[L->pos] == '\n') {
        L->pos++;
        L->line++;
    }
}

static int utf8_put(char *o, unsigned long cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* String literal body with Python's unicode-escape rules; unknown escapes stay as is. */
static int lex_string(lexer *L) {
    char q = L->s[L->pos];
    size_t p = L->pos + 1, start_line = (size_t)L->line;
    while (p < L->len && L->s[p] != q) {
        if (L->s[p] == '\\' && p + 1 < L->len) p++;
        p++;
    }
    if (p >= L->len) return lex_fail(L, "unexpected char '\"' or unterminated string");
    const char *b = L->s + L->pos + 1;
    size_t n = p - L->pos - 1;
    char *o = malloc(n * 2 + 1);
    if (!o) return SPECD_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != '\\' || i + 1 >= n) {
            o[k++] = b[i];
            continue;
        }
        char c = b[++i];
        int hx = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        switch (c) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case 'a': o[k++] = '\a'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'v': o[k++] = '\v'; break;
        case '\\': o[k++] = '\\'; break;
        case '\'': o[k++] = '\''; break;
        case '"': o[k++] = '"'; break;
        case '\n': break;
        default:
            if (hx) {
                unsigned long cp = 0;
                int ok = i + (size_t)hx < n;
                for (int j = 1; ok && j <= hx; j++) {
                    int h = hexval(b[i + (size_t)j]);
                    if (h < 0) ok = 0;
                    else cp = cp * 16 + (unsigned long)h;
                }
                if (!ok || cp > 0x10FFFF) {
                    free(o);
                    return lex_fail(L, "invalid escape in string literal");
                }
                k += (size_t)utf8_put(o + k, cp);
                i += (size_t)hx;
            } else if (c >= '0' && c <= '7') {
                unsigned long cp = 0;
                int j = 0;
                while (j < 3 && i < n && b[i] >= '0' && b[i] <= '7') {
                    cp = cp * 8 + (unsigned long)(b[i] - '0');
                    i++;
                    j++;
                }
                i--;
                k += (size_t)utf8_put(o + k, cp);
            } else {
                o[k++] = '\\';
                o[k++] = c;
            }
        }
    }
    int rc = push(L, TK_STRING, o, k, (int)start_line);
    free(o);
    count_lines(L, L->pos, p + 1);
    L->pos = p + 1;
    return rc;
}

static int lex_number(lexer *L) {
    size_t p = L->pos;
    int is_float = 0;
    while (p < L->len && (isdigit((unsigned char)L->s[p]) || L->s[p] == '_')) p++;
    if (p + 1 < L->len && L->s[p] == '.' && isdigit((unsigned char)L->s[p + 1])) {
        is_float = 1;
        p++;
        while (p < L->len && (isdigit((unsigned char)L->s[p]) || L->s[p] == '_')) p++;
    }
    if (p < L->len && (L->s[p] == 'e' || L->s[p] == 'E')) {
        size_t q = p + 1;
        if (q < L->len && (L->s[q] == '+' || L->s[q] == '-')) q++;
        if (q < L->len && isdigit((unsigned char)L->s[q])) {
            is_float = 1;
            p = q;
            while (p < L->len && (isdigit((unsigned char)L->s[p]) || L->s[p] == '_')) p++;
        }
    }
    char buf[128];
    size_t k = 0;
    for (size_t i = L->pos; i < p && k + 1 < sizeof buf; i++)
        if (L->s[i] != '_') buf[k++] = L->s[i];
    buf[k] = 0;
    int rc = push(L, is_float ? TK_FLOAT : TK_INT, L->s + L->pos, p - L->pos, L->line);
    if (rc) return rc;
    tk_token *t = &L->out->t[L->out->n - 1];
    if (is_float) t->fval = strtod(buf, NULL);
    else t->ival = strtoll(buf, NULL, 10);
    L->pos = p;
    return 0;
}

static const char *const ops2[] = {"//", "**", "==", "!=", "<=", ">=", NULL};

/* Tokens of one {{ }} or {% %} tag, up to and including its closing delimiter. */
static int lex_tag(lexer *L, int is_block) {
    char bal[256];
    size_t nbal = 0;
    const char *close = is_block ? "%}" : "}}";
    for (;;) {
        while (L->pos < L->len && py_space((unsigned char)L->s[L->pos])) {
            if (L->s[L->pos] == '\n') L->line++;
            L->pos++;
        }
        if (L->pos >= L->len) return lex_fail(L, "unexpected end of template");
        const char *c = L->s + L->pos;
        size_t left = L->len - L->pos;
        if (nbal == 0) {
            char sign = 0;
            if (left >= 3 && (c[0] == '-' || c[0] == '+') && !memcmp(c + 1, close, 2))
                sign = c[0];
            if (sign == '+' && !is_block) sign = 0;   /* `+}}` is not a closing form */
            if (sign || (left >= 2 && !memcmp(c, close, 2))) {
                int rc = push(L, is_block ? TK_BLOCK_END : TK_VAR_END, close, 2, L->line);
                if (rc) return rc;
                L->pos += sign ? 3 : 2;
                after_close(L, sign, is_block);
                return 0;
            }
        }
        if (isalpha((unsigned char)*c) || *c == '_') {
            size_t p = L->pos;
            while (p < L->len && (isalnum((unsigned char)L->s[p]) || L->s[p] == '_')) p++;
            int rc = push(L, TK_NAME, c, p - L->pos, L->line);
            if (rc) return rc;
            L->pos = p;
            continue;
        }
        if (isdigit((unsigned char)*c)) {
            int rc = lex_number(L);
            if (rc) return rc;
            continue;
        }
        if (*c == '\'' || *c == '"') {
            int rc = lex_string(L);
            if (rc) return rc;
            continue;
        }
        size_t oplen = 0;
        for (int i = 0; ops2[i]; i++)
            if (left >= 2 && !memcmp(c, ops2[i], 2)) oplen = 2;
        if (!oplen && strchr("+-*/%~<>=()[]{},.:|;", *c)) oplen = 1;
        if (!oplen) {
            char msg[64];
            snprintf(msg, sizeof msg, "unexpected char '%c'", *c);
            return lex_fail(L, msg);
        }
        if (oplen == 1 && strchr("([{", *c)) {
            if (nbal == sizeof bal) return lex_fail(L, "brackets nested too deeply");
            bal[nbal++] = *c == '(' ? ')' : *c == '[' ? ']' : '}';
        } else if (oplen == 1 && strchr(")]}", *c)) {
            char msg[64];
            if (!nbal) {
                snprintf(msg, sizeof msg, "unexpected '%c'", *c);
                return lex_fail(L, msg);
            }
            if (bal[nbal - 1] != *c) {
                snprintf(msg, sizeof msg, "unexpected '%c', expected '%c'", *c, bal[nbal - 1]);
                return lex_fail(L, msg);
            }
            nbal--;
        }
        int rc = push(L, TK_OP, c, oplen, L->line);
        if (rc) return rc;
        L->pos += oplen;
    }
}

/* Does a `{% [+-] raw [-] %}` start at p? Sets *end past it and *close_sign. */
static int match_raw(const lexer *L, size_t p, const char *word, size_t *end, char *close_sign) {
    if (p + 2 > L->len || memcmp(L->s + p, "{%", 2)) return 0;
    p += 2;
    if (p < L->len && (L->s[p] == '-' || L->s[p] == '+')) p++;
    while (p < L->len && py_space((unsigned char)L->s[p])) p++;
    size_t wl = strlen(word);
    if (p + wl > L->len || memcmp(L->s + p, word, wl)) return 0;
    p += wl;
    while (p < L->len && py_space((unsigned char)L->s[p])) p++;
    *close_sign = 0;
    if (p < L->len && (L->s[p] == '-' || L->s[p] == '+')) *close_sign = L->s[p++];
    if (p + 2 > L->len || memcmp(L->s + p, "%}", 2)) return 0;
    *end = p + 2;
    return 1;
}

static int lex_raw(lexer *L, size_t tag_end, char close_sign) {
    L->pos = tag_end;
    if (close_sign == '-') after_close(L, '-', 0);
    for (size_t p = L->pos; p + 1 < L->len; p++) {
        size_t end;
        char sign;
        if (L->s[p] == '{' && match_raw(L, p, "endraw", &end, &sign)) {
            char open = L->s[p + 2] == '-' || L->s[p + 2] == '+' ? L->s[p + 2] : 0;
            int rc = emit_text(L, L->pos, p, open, 1);
            if (rc) return rc;
            count_lines(L, p, end);
            L->pos = end;
            after_close(L, sign, 1);
            return 0;
        }
    }
    return lex_fail(L, "Missing end of raw directive");
}

static int lex_comment(lexer *L) {
    for (size_t p = L->pos; p + 1 < L->len; p++) {
        char sign = 0;
        if ((L->s[p] == '-' || L->s[p] == '+') && p + 2 < L->len && L->s[p + 1] == '#' &&
            L->s[p + 2] == '}')
            sign = L->s[p];
        else if (!(L->s[p] == '#' && L->s[p + 1] == '}'))
            continue;
        count_lines(L, L->pos, p);
        L->pos = p + (sign ? 3 : 2);
        after_close(L, sign, 1);
        return 0;
    }
    return lex_fail(L, "Missing end of comment tag");
}

static int lex_root(lexer *L) {
    while (L->pos < L->len) {
        const char *hit = NULL;
        for (size_t p = L->pos; p + 1 < L->len; p++) {
            if (L->s[p] == '{' && (L->s[p + 1] == '{' || L->s[p + 1] == '%' || L->s[p + 1] == '#')) {
                hit = L->s + p;
                break;
            }
        }
        if (!hit) return emit_text(L, L->pos, L->len, 0, 0);
        size_t at = (size_t)(hit - L->s);
        char kind = hit[1];
        char sign = at + 2 < L->len && (hit[2] == '-' || hit[2] == '+') ? hit[2] : 0;
        int rc = emit_text(L, L->pos, at, sign, kind != '{');
        if (rc) return rc;
        size_t raw_end;
        char raw_sign;
        if (kind == '%' && match_raw(L, at, "raw", &raw_end, &raw_sign)) {
            rc = lex_raw(L, raw_end, raw_sign);
        } else if (kind == '#') {
            L->pos = at + 2 + (sign ? 1 : 0);
            rc = lex_comment(L);
        } else {
            rc = push(L, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, hit, 2, L->line);
            L->pos = at + 2 + (sign ? 1 : 0);
            if (!rc) rc = lex_tag(L, kind == '%');
        }
        if (rc) return rc;
    }
    return 0;
}

int tmpl_lex(const char *src, size_t len, tk_list *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    char *s = malloc(len + 1);
    if (!s) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;
    lexer L = {s, n, 0, 1, out, err, errlen};
    int rc = lex_root(&L);
    if (!rc) rc = push(&L, TK_EOF, "", 0, L.line);
    free(s);
    if (rc == SPECD_ENOMEM) specd_errf(err, errlen, rc, "out of memory");
    if (rc) tmpl_tokens_free(out);
    return rc;
}

void tmpl_tokens_free(tk_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->t[i].s);
    free(l->t);
    memset(l, 0, sizeof *l);
}
