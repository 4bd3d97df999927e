/* Chat-template front end (internal to engine/tmpl*.c): the token stream the lexer makes
 * from Jinja2 source and the syntax tree the parser builds from it.
 *
 * The lexer applies all whitespace control itself (`-`/`+` markers, trim_blocks and
 * lstrip_blocks as HF enables them, the dropped final newline, \r\n -> \n), so the parser
 * sees text tokens that print exactly as they are. Nodes are owned by their template and
 * freed with it; literal values (tv) inside nodes are immortal for the template's life. */
#ifndef SPECD_TMPL_AST_H
#define SPECD_TMPL_AST_H

#include <stddef.h>

#include "engine/text/tmpl_value.h"

typedef enum {
    TK_TEXT, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END,
    TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP, TK_EOF
} tk_type;

typedef struct {
    tk_type type;
    int line;
    char *s;        /* TK_TEXT / TK_STRING: decoded bytes (malloc'd); else the lexeme */
    size_t len;
    int64_t ival;
    double fval;
} tk_token;

typedef struct {
    tk_token *t;
    size_t n, cap;
} tk_list;

/* Tokenize src. 0 ok; else SPECD_ETEMPLATE with "TemplateSyntaxError: ... (line N)". */
int tmpl_lex(const char *src, size_t len, tk_list *out, char *err, size_t errlen);
void tmpl_tokens_free(tk_list *l);

typedef enum {
    /* expressions */
    N_LIT, N_NAME, N_ATTR, N_ITEM, N_SLICE, N_CALL, N_FILTER, N_TEST, N_NOT, N_NEG,
    N_POS, N_BIN, N_AND, N_OR, N_COMPARE, N_COND, N_LIST, N_TUPLE, N_DICT,
    /* statements */
    S_TEXT, S_OUTPUT, S_IF, S_FOR, S_SET, S_SETBLOCK, S_MACRO, S_BREAK, S_CONTINUE,
    S_FILTERBLOCK, S_BLOCK, S_CALLBLOCK, S_WITH
} node_type;

/* Binary / comparison operators (N_BIN op, N_COMPARE ops[]). */
enum {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN
};

typedef struct tnode tnode;
typedef struct {
    tnode **v;
    size_t n, cap;
} tnode_list;

/* One node type for everything; which fields mean what:
 *   N_LIT      value
 *   N_NAME     name
 *   N_ATTR     a.name
 *   N_ITEM     a[b]                      N_SLICE  a[b:c:d] (b, c, d may be NULL)
 *   N_CALL     a(l1..., names[i]=l2[i])  N_FILTER a|name(l1..., kw)   N_TEST a is [not] name(l1)
 *   N_NOT/NEG/POS a                      N_BIN/N_AND/N_OR  a op b
 *   N_COMPARE  a ops[0] l1[0] ops[1] l1[1] ...
 *   N_COND     b if a else c (c NULL: undefined)
 *   N_LIST/N_TUPLE l1                    N_DICT   keys l1, values l2
 *   S_TEXT     value (str)               S_OUTPUT a
 *   S_IF       if a: l1 else: l2 (elif is a nested S_IF in l2)
 *   S_FOR      for names in a [if b]: l1 else: l2
 *   S_SET      names (one or tuple) or a (N_ATTR target, ns.x) = b
 *   S_SETBLOCK names[0] = render(l1), then filters in l2 (N_FILTER with a NULL)
 *   S_MACRO    macro name(names = l1 defaults, NULL when none): l2
 *   S_FILTERBLOCK render(l1) through filters in l2
 *   S_BLOCK    l1 (generation blocks, {% block %} and other transparent wrappers)
 *   S_WITH     with names = l2 (values): l1, in a new scope
 *   S_CALLBLOCK call a with caller() = l1 */
struct tnode {
    node_type type;
    int line;
    int op;             /* N_BIN op; N_TEST: 1 when negated */
    char *name;
    tv *value;
    tnode *a, *b, *c, *d;
    tnode_list l1, l2;
    char **names;       /* for targets, macro params, kwarg names of N_CALL/N_FILTER */
    size_t nnames;
    int *ops;           /* N_COMPARE */
    int depth;          /* height of the expression tree below (bounded by the parser) */
    char **undef;       /* scope statements: names that start Undefined in the frame */
    size_t nundef;      /* (tmpl_scope.c; the strings belong to names/name of nodes) */
};

/* Parse a token list into a body (S_* statements). NULL + message on a syntax error. */
tnode_list *tmpl_parse_tokens(const tk_list *toks, char *err, size_t errlen);
void tmpl_body_free(tnode_list *body);
void tmpl_node_free(tnode *n);

/* jinja2's compile-time scoping (tmpl_scope.c): fills each scope node's undef list and
 * *root_undef (malloc'd array of borrowed names) for the template itself. 0 or ENOMEM. */
int tmpl_analyse_scopes(tnode_list *body, char ***root_undef, size_t *nroot_undef);

#endif
