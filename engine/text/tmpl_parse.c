/* Chat-template parser: tokens -> syntax tree, recursive descent with jinja2's grammar and
 * operator precedence (lowest first): inline if, or, and, not, comparisons (chained),
 * + -, ~, * / // %, ** (left-associative, as in jinja2), unary - +, then primaries with
 * postfix . [] () and the filter/test chain (| name, is name). Nesting depth is bounded
 * so a hostile template cannot overflow the C stack. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tmpl_ast.h"

#define MAX_DEPTH 200

typedef struct {
    const tk_list *toks;
    size_t i;
    int depth;
    char *err;
    size_t errlen;
    int failed;
} parser;

static tnode *parse_expr(parser *P);
static tnode *parse_tuple(parser *P, int allow_empty);
static int parse_body(parser *P, tnode_list *body, const char *const *ends, const char **hit);

static tk_token *cur(parser *P) { return &P->toks->t[P->i]; }
static tk_token *peek(parser *P, size_t k) {
    size_t j = P->i + k;
    return &P->toks->t[j < P->toks->n ? j : P->toks->n - 1];
}

/* Token as jinja2's describe_token names it: names and operators by their text,
 * literals by their type. */
static const char *tok_desc(const tk_token *t) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_END: return "end of statement block";
    case TK_VAR_BEGIN: return "begin of print statement";
    case TK_BLOCK_BEGIN: return "begin of statement block";
    case TK_TEXT: return "template data / text";
    case TK_STRING: return "string";
    case TK_INT: return "integer";
    case TK_FLOAT: return "float";
    default: return t->s;
    }
}

static void *fail(parser *P, const char *fmt, const char *a) {
    if (!P->failed) {
        char msg[256];
        snprintf(msg, sizeof msg, fmt, a);
        specd_errf(P->err, P->errlen, SPECD_ETEMPLATE, "TemplateSyntaxError: %s (line %d)", msg,
                   cur(P)->line);
        P->failed = 1;
    }
    return NULL;
}

static int is_op(parser *P, const char *op) {
    tk_token *t = cur(P);
    return t->type == TK_OP && !strcmp(t->s, op);
}
static int is_name(parser *P, const char *name) {
    tk_token *t = cur(P);
    return t->type == TK_NAME && !strcmp(t->s, name);
}
static int accept_op(parser *P, const char *op) {
    if (!is_op(P, op)) return 0;
    P->i++;
    return 1;
}
static int accept_name(parser *P, const char *name) {
    if (!is_name(P, name)) return 0;
    P->i++;
    return 1;
}
static int expect_op(parser *P, const char *op) {
    if (accept_op(P, op)) return 1;
    char msg[64];
    snprintf(msg, sizeof msg, "expected token '%s', got '%%s'", op);
    fail(P, msg, tok_desc(cur(P)));
    return 0;
}
/* The current token's name (consumed), or NULL after reporting that a name was expected. */
static const char *expect_name(parser *P) {
    tk_token *t = cur(P);
    if (t->type != TK_NAME) return fail(P, "expected a name, got '%s'", tok_desc(t));
    P->i++;
    return t->s;
}

/* Operator, postfix and filter chains are built in loops, so their trees can grow deep
 * without the parser recursing; every tree walk (evaluation, freeing) recurses, so the
 * height is bounded here. Returns n, or NULL (n freed) when it is too deep. */
#define MAX_TREE_DEPTH 400

static tnode *deepen(parser *P, tnode *n) {
    if (!n) return NULL;
    int d = 0;
    const tnode *kids[] = {n->a, n->b, n->c, n->d};
    for (int i = 0; i < 4; i++)
        if (kids[i] && kids[i]->depth > d) d = kids[i]->depth;
    for (size_t i = 0; i < n->l1.n; i++)
        if (n->l1.v[i] && n->l1.v[i]->depth > d) d = n->l1.v[i]->depth;
    for (size_t i = 0; i < n->l2.n; i++)
        if (n->l2.v[i] && n->l2.v[i]->depth > d) d = n->l2.v[i]->depth;
    n->depth = d + 1;
    if (n->depth > MAX_TREE_DEPTH) {
        tmpl_node_free(n);
        return fail(P, "%s", "expression nested too deeply");
    }
    return n;
}

static tnode *node_new(parser *P, node_type type) {
    tnode *n = calloc(1, sizeof *n);
    if (!n) return fail(P, "%s", "out of memory");
    n->type = type;
    n->line = cur(P)->line;
    return n;
}

static int list_push(parser *P, tnode_list *l, tnode *n) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        tnode **nv = realloc(l->v, cap * sizeof *nv);
        if (!nv) {
            fail(P, "%s", "out of memory");
            return -1;
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = n;
    return 0;
}

/* Parse an expression onto l; -1 (nothing pushed, the expression freed) on failure. */
static int push_expr(parser *P, tnode_list *l) {
    tnode *v = parse_expr(P);
    if (!v || list_push(P, l, v)) {
        tmpl_node_free(v);
        return -1;
    }
    return 0;
}

static int names_push(parser *P, tnode *n, const char *s) {
    char **nv = realloc(n->names, (n->nnames + 1) * sizeof *nv);
    if (!nv) {
        fail(P, "%s", "out of memory");
        return -1;
    }
    n->names = nv;
    n->names[n->nnames] = strdup(s);
    if (!n->names[n->nnames]) {
        fail(P, "%s", "out of memory");
        return -1;
    }
    n->nnames++;
    return 0;
}

static void list_free(tnode_list *l) {
    for (size_t i = 0; i < l->n; i++) tmpl_node_free(l->v[i]);
    free(l->v);
}

void tmpl_node_free(tnode *n) {
    if (!n) return;
    free(n->name);
    tv_free_literal(n->value);
    tmpl_node_free(n->a);
    tmpl_node_free(n->b);
    tmpl_node_free(n->c);
    tmpl_node_free(n->d);
    list_free(&n->l1);
    list_free(&n->l2);
    for (size_t i = 0; i < n->nnames; i++) free(n->names[i]);
    free(n->names);
    free(n->ops);
    free(n->undef);
    free(n);
}

void tmpl_body_free(tnode_list *body) {
    if (!body) return;
    list_free(body);
    free(body);
}

static tnode *lit(parser *P, tv *v) {
    if (!v) return fail(P, "%s", "out of memory");
    tnode *n = node_new(P, N_LIT);
    if (!n) {
        tv_unref(v);
        return NULL;
    }
    n->value = v;
    tv_make_literal(v);
    return n;
}

/* Call arguments after '(' up to ')': positional into n->l1, keywords into names/l2. */
static int parse_call_args(parser *P, tnode *n) {
    while (!is_op(P, ")")) {
        if (n->l1.n + n->l2.n && !expect_op(P, ",")) return -1;
        if (is_op(P, ")")) break;
        if (cur(P)->type == TK_NAME && peek(P, 1)->type == TK_OP && !strcmp(peek(P, 1)->s, "=")) {
            if (names_push(P, n, cur(P)->s)) return -1;
            P->i += 2;
            if (push_expr(P, &n->l2)) return -1;
        } else {
            if (n->l2.n) {
                fail(P, "%s", "positional argument follows keyword argument");
                return -1;
            }
            if (push_expr(P, &n->l1)) return -1;
        }
    }
    P->i++;
    return 0;
}

static tnode *parse_primary(parser *P) {
    tk_token *t = cur(P);
    if (t->type == TK_NAME) {
        P->i++;
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) return lit(P, tv_bool(1));
        if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) return lit(P, tv_bool(0));
        if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) return lit(P, tv_none());
        tnode *n = node_new(P, N_NAME);
        if (n && !(n->name = strdup(t->s))) {
            tmpl_node_free(n);
            return fail(P, "%s", "out of memory");
        }
        return n;
    }
    if (t->type == TK_STRING) {
        /* adjacent literals concatenate: "a" "b" */
        tv_buf b = {0};
        while (cur(P)->type == TK_STRING) {
            tv_buf_put(&b, cur(P)->s, cur(P)->len);
            P->i++;
        }
        if (b.oom) {
            tv_buf_free(&b);
            return fail(P, "%s", "out of memory");
        }
        size_t len;
        char *s = tv_buf_take(&b, &len);
        return lit(P, s ? tv_str_take(s, len) : NULL);
    }
    if (t->type == TK_INT) {
        P->i++;
        return lit(P, tv_int(t->ival));
    }
    if (t->type == TK_FLOAT) {
        P->i++;
        return lit(P, tv_float(t->fval));
    }
    if (accept_op(P, "(")) {
        tnode *n = parse_tuple(P, 1);
        if (n && !expect_op(P, ")")) {
            tmpl_node_free(n);
            return NULL;
        }
        return n;
    }
    if (accept_op(P, "[")) {
        tnode *n = node_new(P, N_LIST);
        while (n && !is_op(P, "]")) {
            if (n->l1.n && !expect_op(P, ",")) goto bad;
            if (is_op(P, "]")) break;
            if (push_expr(P, &n->l1)) goto bad;
        }
        if (n) P->i++;
        return n;
    bad:
        tmpl_node_free(n);
        return NULL;
    }
    if (accept_op(P, "{")) {
        tnode *n = node_new(P, N_DICT);
        while (n && !is_op(P, "}")) {
            if (n->l1.n && !expect_op(P, ",")) goto bad2;
            if (is_op(P, "}")) break;
            if (push_expr(P, &n->l1)) goto bad2;
            if (!expect_op(P, ":")) goto bad2;
            if (push_expr(P, &n->l2)) goto bad2;
        }
        if (n) P->i++;
        return n;
    bad2:
        tmpl_node_free(n);
        return NULL;
    }
    return fail(P, "unexpected '%s'", tok_desc(t));
}

static tnode *parse_subscript_part(parser *P) {
    if (is_op(P, ":") || is_op(P, "]") || is_op(P, ",")) return NULL;
    return parse_expr(P);
}

/* a[...] : an index or a slice a[b:c:d] */
static tnode *parse_subscript(parser *P, tnode *obj) {
    tnode *n = node_new(P, N_ITEM);
    if (!n) return tmpl_node_free(obj), NULL;
    n->a = obj;
    n->b = parse_subscript_part(P);
    if (P->failed) goto bad;
    if (n->b && is_op(P, ",")) {   /* x[a, b] subscripts with a tuple */
        tnode *t = node_new(P, N_TUPLE), *first = n->b;
        if (!t) goto bad;
        n->b = t;
        if (list_push(P, &t->l1, first)) {
            tmpl_node_free(first);
            goto bad;
        }
        while (accept_op(P, ",") && !is_op(P, "]")) {
            if (push_expr(P, &t->l1)) goto bad;
        }
    } else if (accept_op(P, ":")) {
        n->type = N_SLICE;
        n->c = parse_subscript_part(P);
        if (P->failed) goto bad;
        if (accept_op(P, ":")) {
            n->d = parse_subscript_part(P);
            if (P->failed) goto bad;
        }
    } else if (!n->b) {
        fail(P, "unexpected '%s'", tok_desc(cur(P)));
        goto bad;
    }
    if (!expect_op(P, "]")) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

static tnode *parse_postfix(parser *P, tnode *n) {
    while (n) {
        if (accept_op(P, ".")) {
            tk_token *t = cur(P);
            if (t->type == TK_NAME) {
                tnode *a = node_new(P, N_ATTR);
                if (!a) return tmpl_node_free(n), NULL;
                a->a = n;
                n = a;
                if (!(a->name = strdup(t->s))) return tmpl_node_free(n), fail(P, "%s", "oom");
                P->i++;
            } else if (t->type == TK_INT) {   /* x.0 is x[0] */
                tnode *a = node_new(P, N_ITEM);
                if (!a) return tmpl_node_free(n), NULL;
                a->a = n;
                n = a;
                P->i++;
                if (!(a->b = lit(P, tv_int(t->ival)))) return tmpl_node_free(n), NULL;
            } else {
                tmpl_node_free(n);
                return fail(P, "expected name or number, got '%s'", tok_desc(t));
            }
        } else if (accept_op(P, "[")) {
            n = parse_subscript(P, n);
        } else if (accept_op(P, "(")) {
            tnode *c = node_new(P, N_CALL);
            if (!c) return tmpl_node_free(n), NULL;
            c->a = n;
            n = c;
            if (parse_call_args(P, c)) return tmpl_node_free(n), NULL;
        } else {
            break;
        }
        n = deepen(P, n);
    }
    return n;
}

/* name or dotted.name after | or is */
static char *parse_dotted_name(parser *P) {
    const char *first = expect_name(P);
    if (!first) return NULL;
    tv_buf b = {0};
    tv_buf_puts(&b, first);
    while (is_op(P, ".") && peek(P, 1)->type == TK_NAME) {
        tv_buf_puts(&b, ".");
        tv_buf_puts(&b, peek(P, 1)->s);
        P->i += 2;
    }
    return tv_buf_take(&b, NULL);
}

static tnode *parse_filter(parser *P, tnode *operand) {
    tnode *f = node_new(P, N_FILTER);
    if (!f) return tmpl_node_free(operand), NULL;
    f->a = operand;
    if (!(f->name = parse_dotted_name(P))) return tmpl_node_free(f), NULL;
    if (accept_op(P, "(") && parse_call_args(P, f)) return tmpl_node_free(f), NULL;
    return deepen(P, f);
}

static tnode *parse_unary(parser *P, int with_filter);

static tnode *parse_test(parser *P, tnode *operand) {
    tnode *t = node_new(P, N_TEST);
    if (!t) return tmpl_node_free(operand), NULL;
    t->a = operand;
    if (accept_name(P, "not")) t->op = 1;
    if (!(t->name = parse_dotted_name(P))) return tmpl_node_free(t), NULL;
    tk_token *c = cur(P);
    if (accept_op(P, "(")) {
        if (parse_call_args(P, t)) return tmpl_node_free(t), NULL;
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT ||
                c->type == TK_FLOAT || is_op(P, "[") || is_op(P, "{")) &&
               !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
        if (is_name(P, "is")) return tmpl_node_free(t), fail(P, "%s", "You cannot chain multiple tests with is");
        tnode *arg = parse_postfix(P, parse_primary(P));
        if (!arg || list_push(P, &t->l1, arg)) return tmpl_node_free(arg), tmpl_node_free(t), NULL;
    }
    return deepen(P, t);
}

static tnode *parse_filter_expr(parser *P, tnode *n) {
    while (n) {
        if (accept_op(P, "|")) n = parse_filter(P, n);
        else if (accept_name(P, "is")) n = parse_test(P, n);
        else if (accept_op(P, "(")) {
            tnode *c = node_new(P, N_CALL);
            if (!c) return tmpl_node_free(n), NULL;
            c->a = n;
            n = c;
            if (parse_call_args(P, c)) return tmpl_node_free(n), NULL;
            n = deepen(P, n);
        } else break;
    }
    return n;
}

static tnode *unary_node(parser *P, node_type type, tnode *a) {
    if (!a) return NULL;
    tnode *n = node_new(P, type);
    if (!n) return tmpl_node_free(a), NULL;
    n->a = a;
    return deepen(P, n);
}

static tnode *parse_unary(parser *P, int with_filter) {
    if (++P->depth > MAX_DEPTH) return fail(P, "%s", "expression nested too deeply");
    tnode *n;
    if (accept_op(P, "-")) n = unary_node(P, N_NEG, parse_unary(P, 0));
    else if (accept_op(P, "+")) n = unary_node(P, N_POS, parse_unary(P, 0));
    else n = parse_postfix(P, parse_primary(P));
    if (with_filter) n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

static tnode *bin(parser *P, node_type type, int op, tnode *l, tnode *r) {
    if (!l || !r) {
        tmpl_node_free(l);
        tmpl_node_free(r);
        return NULL;
    }
    tnode *n = node_new(P, type);
    if (!n) {
        tmpl_node_free(l);
        tmpl_node_free(r);
        return NULL;
    }
    n->op = op;
    n->a = l;
    n->b = r;
    n->line = l->line;
    return deepen(P, n);
}

static tnode *parse_pow(parser *P) {
    tnode *n = parse_unary(P, 1);
    while (n && accept_op(P, "**")) n = bin(P, N_BIN, OP_POW, n, parse_unary(P, 1));
    return n;
}

static tnode *parse_math2(parser *P) {
    tnode *n = parse_pow(P);
    for (;;) {
        int op = accept_op(P, "*") ? OP_MUL : accept_op(P, "/") ? OP_DIV
               : accept_op(P, "//") ? OP_FLOORDIV : accept_op(P, "%") ? OP_MOD : -1;
        if (op < 0 || !n) return n;
        n = bin(P, N_BIN, op, n, parse_pow(P));
    }
}

static tnode *parse_concat(parser *P) {
    tnode *n = parse_math2(P);
    while (n && accept_op(P, "~")) n = bin(P, N_BIN, OP_CONCAT, n, parse_math2(P));
    return n;
}

static tnode *parse_math1(parser *P) {
    tnode *n = parse_concat(P);
    for (;;) {
        int op = accept_op(P, "+") ? OP_ADD : accept_op(P, "-") ? OP_SUB : -1;
        if (op < 0 || !n) return n;
        n = bin(P, N_BIN, op, n, parse_concat(P));
    }
}

static int compare_op(parser *P) {
    static const struct { const char *s; int op; } ops[] = {
        {"==", OP_EQ}, {"!=", OP_NE}, {"<", OP_LT}, {"<=", OP_LE}, {">", OP_GT}, {">=", OP_GE}};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (accept_op(P, ops[i].s)) return ops[i].op;
    if (accept_name(P, "in")) return OP_IN;
    if (is_name(P, "not") && peek(P, 1)->type == TK_NAME && !strcmp(peek(P, 1)->s, "in")) {
        P->i += 2;
        return OP_NOTIN;
    }
    return -1;
}

static tnode *parse_compare(parser *P) {
    tnode *n = parse_math1(P);
    if (!n) return NULL;
    tnode *cmp = NULL;
    int op;
    while ((op = compare_op(P)) >= 0) {
        if (!cmp) {
            if (!(cmp = node_new(P, N_COMPARE))) return tmpl_node_free(n), NULL;
            cmp->a = n;
            cmp->line = n->line;
        }
        int *nops = realloc(cmp->ops, (cmp->l1.n + 1) * sizeof *nops);
        if (!nops) return tmpl_node_free(cmp), fail(P, "%s", "out of memory");
        cmp->ops = nops;
        tnode *r = parse_math1(P);
        if (!r || list_push(P, &cmp->l1, r)) return tmpl_node_free(r), tmpl_node_free(cmp), NULL;
        cmp->ops[cmp->l1.n - 1] = op;
    }
    return cmp ? deepen(P, cmp) : n;
}

static tnode *parse_not(parser *P) {
    if (accept_name(P, "not")) {
        if (++P->depth > MAX_DEPTH) return fail(P, "%s", "expression nested too deeply");
        tnode *n = unary_node(P, N_NOT, parse_not(P));
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static tnode *parse_and(parser *P) {
    tnode *n = parse_not(P);
    while (n && accept_name(P, "and")) n = bin(P, N_AND, 0, n, parse_not(P));
    return n;
}

static tnode *parse_or(parser *P) {
    tnode *n = parse_and(P);
    while (n && accept_name(P, "or")) n = bin(P, N_OR, 0, n, parse_and(P));
    return n;
}

static tnode *parse_expr(parser *P) {
    if (++P->depth > MAX_DEPTH) return fail(P, "%s", "expression nested too deeply");
    tnode *n = parse_or(P);
    while (n && accept_name(P, "if")) {
        tnode *c = node_new(P, N_COND);
        if (!c) return tmpl_node_free(n), NULL;
        c->b = n;
        n = c;
        if (!(c->a = parse_or(P))) return tmpl_node_free(n), NULL;
        if (accept_name(P, "else") && !(c->c = parse_expr(P))) return tmpl_node_free(n), NULL;
        n = deepen(P, n);
    }
    P->depth--;
    return n;
}

/* expr or a, b, c (a tuple); allow_empty: "()" is an empty tuple */
static tnode *parse_tuple(parser *P, int allow_empty) {
    if (allow_empty && is_op(P, ")")) return node_new(P, N_TUPLE);
    tnode *first = parse_expr(P);
    if (!first || !is_op(P, ",")) return first;
    tnode *t = node_new(P, N_TUPLE);
    if (!t || list_push(P, &t->l1, first)) return tmpl_node_free(first), tmpl_node_free(t), NULL;
    while (accept_op(P, ",")) {
        if (is_op(P, ")") || cur(P)->type == TK_VAR_END || cur(P)->type == TK_BLOCK_END) break;
        if (push_expr(P, &t->l1)) return tmpl_node_free(t), NULL;
    }
    return t;
}

/* ---- statements ---- */

static int expect_block_end(parser *P) {
    if (cur(P)->type == TK_BLOCK_END) {
        P->i++;
        return 0;
    }
    fail(P, "expected token 'end of statement block', got '%s'", tok_desc(cur(P)));
    return -1;
}

/* for/set targets: name or name, name, ... */
static int parse_targets(parser *P, tnode *n) {
    do {
        const char *name = expect_name(P);
        if (!name || names_push(P, n, name)) return -1;
    } while (accept_op(P, ","));
    return 0;
}

static tnode *parse_for(parser *P) {
    tnode *n = node_new(P, S_FOR);
    if (!n) return NULL;
    accept_op(P, "(");
    if (parse_targets(P, n)) goto bad;
    accept_op(P, ")");
    if (!accept_name(P, "in")) {
        fail(P, "expected 'in', got '%s'", tok_desc(cur(P)));
        goto bad;
    }
    /* the iterable cannot contain an unparenthesised inline if: `if` starts the filter */
    {
        tnode *it = parse_or(P);
        if (!it) goto bad;
        if (is_op(P, ",")) {
            tnode *t = node_new(P, N_TUPLE);
            if (!t || list_push(P, &t->l1, it)) {
                tmpl_node_free(it);
                tmpl_node_free(t);
                goto bad;
            }
            it = t;
            while (accept_op(P, ",")) {
                if (cur(P)->type == TK_BLOCK_END || is_name(P, "if")) break;
                tnode *v = parse_or(P);
                if (!v || list_push(P, &t->l1, v)) {
                    tmpl_node_free(v);
                    tmpl_node_free(it);
                    goto bad;
                }
            }
        }
        n->a = it;
    }
    if (accept_name(P, "if") && !(n->b = parse_expr(P))) goto bad;
    accept_name(P, "recursive");
    if (expect_block_end(P)) goto bad;
    static const char *const ends[] = {"endfor", "else", NULL};
    const char *hit;
    if (parse_body(P, &n->l1, ends, &hit)) goto bad;
    if (!strcmp(hit, "else")) {
        static const char *const ends2[] = {"endfor", NULL};
        if (expect_block_end(P) || parse_body(P, &n->l2, ends2, &hit)) goto bad;
    }
    if (expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

static tnode *parse_if(parser *P) {
    tnode *n = node_new(P, S_IF);
    if (!n) return NULL;
    if (!(n->a = parse_tuple(P, 0)) || expect_block_end(P)) goto bad;
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    const char *hit;
    if (parse_body(P, &n->l1, ends, &hit)) goto bad;
    if (!strcmp(hit, "elif")) {
        tnode *e = parse_if(P);   /* consumes through the shared endif */
        if (!e || list_push(P, &n->l2, e)) {
            tmpl_node_free(e);
            goto bad;
        }
        return n;
    }
    if (!strcmp(hit, "else")) {
        static const char *const ends2[] = {"endif", NULL};
        if (expect_block_end(P) || parse_body(P, &n->l2, ends2, &hit)) goto bad;
    }
    if (expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

/* filters after `{% set x |` or `{% filter` : stored as N_FILTER nodes with no operand */
static int parse_filter_chain(parser *P, tnode_list *l, int need_first) {
    while (need_first || accept_op(P, "|")) {
        need_first = 0;
        tnode *f = parse_filter(P, NULL);
        if (!f || list_push(P, l, f)) return tmpl_node_free(f), -1;
    }
    return 0;
}

static tnode *parse_set(parser *P) {
    tnode *n = node_new(P, S_SET);
    if (!n) return NULL;
    if (cur(P)->type == TK_NAME && peek(P, 1)->type == TK_OP && !strcmp(peek(P, 1)->s, ".")) {
        /* namespace attribute: {% set ns.x = ... %} */
        tnode *t = node_new(P, N_ATTR);
        if (!t) goto bad;
        n->a = t;
        if (!(t->a = parse_primary(P))) goto bad;
        P->i++;
        const char *name = expect_name(P);
        if (!name || !(t->name = strdup(name))) goto bad;
    } else if (parse_targets(P, n)) {
        goto bad;
    }
    if (accept_op(P, "=")) {
        if (!(n->b = parse_tuple(P, 0)) || expect_block_end(P)) goto bad;
        return n;
    }
    if (n->a || n->nnames != 1) {
        fail(P, "expected token '=', got '%s'", tok_desc(cur(P)));
        goto bad;
    }
    n->type = S_SETBLOCK;
    if (parse_filter_chain(P, &n->l2, 0) || expect_block_end(P)) goto bad;
    static const char *const ends[] = {"endset", NULL};
    const char *hit;
    if (parse_body(P, &n->l1, ends, &hit) || expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

static tnode *parse_macro(parser *P) {
    tnode *n = node_new(P, S_MACRO);
    if (!n) return NULL;
    const char *name = expect_name(P);
    if (!name || !(n->name = strdup(name))) goto bad;
    if (!expect_op(P, "(")) goto bad;
    while (!accept_op(P, ")")) {
        if (n->nnames && !expect_op(P, ",")) goto bad;
        if (accept_op(P, ")")) break;
        const char *arg = expect_name(P);
        if (!arg || names_push(P, n, arg)) goto bad;
        tnode *def = NULL;
        if (accept_op(P, "=") && !(def = parse_expr(P))) goto bad;
        if (!def && n->l1.n && n->l1.v[n->l1.n - 1]) {
            fail(P, "%s", "non-default argument follows default argument");
            goto bad;
        }
        if (list_push(P, &n->l1, def)) {
            tmpl_node_free(def);
            goto bad;
        }
    }
    if (expect_block_end(P)) goto bad;
    static const char *const ends[] = {"endmacro", NULL};
    const char *hit;
    if (parse_body(P, &n->l2, ends, &hit)) goto bad;
    if (cur(P)->type == TK_NAME) P->i++;   /* {% endmacro name %} */
    if (expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

static tnode *parse_wrapped(parser *P, node_type type, const char *end) {
    tnode *n = node_new(P, type);
    if (!n) return NULL;
    if (type == S_FILTERBLOCK && parse_filter_chain(P, &n->l2, 1)) goto bad;
    if (type == S_CALLBLOCK) {
        tnode *c = parse_expr(P);
        if (!c) goto bad;
        n->a = c;
        if (c->type != N_CALL) {
            fail(P, "%s", "expected call");
            goto bad;
        }
    }
    if (expect_block_end(P)) goto bad;
    const char *ends[] = {end, NULL};
    const char *hit;
    if (parse_body(P, &n->l1, ends, &hit) || expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

/* {% with a = 1, b = x %} ... {% endwith %} */
static tnode *parse_with(parser *P) {
    tnode *n = node_new(P, S_WITH);
    if (!n) return NULL;
    while (cur(P)->type != TK_BLOCK_END) {
        if (n->nnames && !expect_op(P, ",")) goto bad;
        const char *name = expect_name(P);
        if (!name || names_push(P, n, name)) goto bad;
        if (!expect_op(P, "=")) goto bad;
        if (push_expr(P, &n->l2)) goto bad;
    }
    P->i++;
    static const char *const ends[] = {"endwith", NULL};
    const char *hit;
    if (parse_body(P, &n->l1, ends, &hit) || expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

/* {% block name %} ... {% endblock [name] %}: without inheritance it renders in place */
static tnode *parse_block(parser *P) {
    if (!expect_name(P)) return NULL;
    accept_name(P, "scoped");
    accept_name(P, "required");
    tnode *n = node_new(P, S_BLOCK);
    if (!n) return NULL;
    static const char *const ends[] = {"endblock", NULL};
    const char *hit;
    if (expect_block_end(P) || parse_body(P, &n->l1, ends, &hit)) goto bad;
    if (cur(P)->type == TK_NAME) P->i++;
    if (expect_block_end(P)) goto bad;
    return n;
bad:
    tmpl_node_free(n);
    return NULL;
}

static tnode *parse_statement(parser *P) {
    tk_token *t = cur(P);
    if (t->type != TK_NAME) return fail(P, "tag name expected, got '%s'", tok_desc(t));
    P->i++;
    const char *s = t->s;
    if (!strcmp(s, "if")) return parse_if(P);
    if (!strcmp(s, "for")) return parse_for(P);
    if (!strcmp(s, "set")) return parse_set(P);
    if (!strcmp(s, "macro")) return parse_macro(P);
    if (!strcmp(s, "filter")) return parse_wrapped(P, S_FILTERBLOCK, "endfilter");
    if (!strcmp(s, "generation")) return parse_wrapped(P, S_BLOCK, "endgeneration");
    if (!strcmp(s, "call")) return parse_wrapped(P, S_CALLBLOCK, "endcall");
    if (!strcmp(s, "with")) return parse_with(P);
    if (!strcmp(s, "block")) return parse_block(P);
    if (!strcmp(s, "break") || !strcmp(s, "continue")) {
        tnode *n = node_new(P, s[0] == 'b' ? S_BREAK : S_CONTINUE);
        if (n && expect_block_end(P)) {
            tmpl_node_free(n);
            return NULL;
        }
        return n;
    }
    P->i--;
    return fail(P, "Encountered unknown tag '%s'.", s);
}

/* Statements until one of `ends` (a block whose first name is in the list); leaves the
 * parser just after that name and sets *hit. ends == NULL: until end of template. */
static int parse_body(parser *P, tnode_list *body, const char *const *ends, const char **hit) {
    if (++P->depth > MAX_DEPTH) {
        fail(P, "%s", "blocks nested too deeply");
        return -1;
    }
    for (;;) {
        tk_token *t = cur(P);
        if (t->type == TK_EOF) {
            if (!ends) break;
            char msg[160];
            snprintf(msg, sizeof msg, "Unexpected end of template. Jinja was looking for the "
                     "following tags: '%s'.", ends[0]);
            fail(P, "%s", msg);
            return -1;
        }
        tnode *n = NULL;
        if (t->type == TK_TEXT) {
            n = node_new(P, S_TEXT);
            if (n && (n->value = tv_str(t->s, t->len))) tv_make_literal(n->value);
            if (n && !n->value) {
                tmpl_node_free(n);
                n = fail(P, "%s", "out of memory");
            }
            P->i++;
        } else if (t->type == TK_VAR_BEGIN) {
            P->i++;
            n = node_new(P, S_OUTPUT);
            if (n && !(n->a = parse_tuple(P, 0))) {
                tmpl_node_free(n);
                n = NULL;
            }
            if (n && cur(P)->type != TK_VAR_END) {
                tmpl_node_free(n);
                n = fail(P, "expected token 'end of print statement', got '%s'", tok_desc(cur(P)));
            }
            P->i++;
        } else if (t->type == TK_BLOCK_BEGIN) {
            P->i++;
            tk_token *nm = cur(P);
            for (size_t k = 0; ends && ends[k] && nm->type == TK_NAME; k++) {
                if (!strcmp(nm->s, ends[k])) {
                    P->i++;
                    *hit = ends[k];
                    P->depth--;
                    return 0;
                }
            }
            if (nm->type == TK_NAME && (!strncmp(nm->s, "end", 3) || !strcmp(nm->s, "elif") ||
                                        !strcmp(nm->s, "else"))) {
                char msg[200];
                snprintf(msg, sizeof msg, "Encountered unknown tag '%s'.%s", nm->s,
                         ends ? " Jinja was looking for the following tags: " : "");
                return fail(P, ends ? "%s'...'." : "%s", msg), -1;
            }
            n = parse_statement(P);
        } else {
            n = fail(P, "unexpected '%s'", tok_desc(t));
        }
        if (!n || list_push(P, body, n)) {
            tmpl_node_free(n);
            return -1;
        }
    }
    P->depth--;
    return 0;
}

tnode_list *tmpl_parse_tokens(const tk_list *toks, char *err, size_t errlen) {
    parser P = {toks, 0, 0, err, errlen, 0};
    tnode_list *body = calloc(1, sizeof *body);
    if (!body) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    if (parse_body(&P, body, NULL, NULL)) {
        tmpl_body_free(body);
        return NULL;
    }
    return body;
}
