/* Chat-template scope analysis: reproduces the one place where jinja2's compile-time
 * scoping differs from looking names up through enclosing frames at run time.
 *
 * jinja2 gives every frame (the template, a for body, a macro, a set/filter/call block, a
 * with, a block) its own symbols. Walking a frame's statements in order, a name whose
 * first mention is an assignment (outside any if), and that no enclosing frame mentions
 * at all, starts out *undefined* in that frame, even if the render context has it; so a
 * loop or macro that reads it before the assignment sees Undefined, not the context:
 *
 *     {% for m in messages %}{{ x }}{% endfor %}{% set x = 1 %}   -> x is Undefined inside
 *
 * This pass finds those names; the interpreter defines them as Undefined when it enters
 * the frame. Everything else (first mention a read, assignments inside if branches,
 * names the parent knows) behaves like run-time lookup already. */
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tmpl_ast.h"

typedef struct sframe {
    const struct sframe *parent;
    const char **refs;      /* names this frame mentions (borrowed from the tree) */
    size_t nrefs, cap;
    char ***undef;          /* where the frame's start-undefined names go */
    size_t *nundef;
    tnode **kids;           /* nested scopes met, analysed after this frame */
    size_t nkids, kcap;
    int oom;
} sframe;

static int has_ref(const sframe *f, const char *name) {
    for (size_t i = 0; i < f->nrefs; i++)
        if (!strcmp(f->refs[i], name)) return 1;
    return 0;
}

static int ancestor_ref(const sframe *f, const char *name) {
    for (; f; f = f->parent)
        if (has_ref(f, name)) return 1;
    return 0;
}

static void add_ref(sframe *f, const char *name) {
    if (has_ref(f, name)) return;
    if (f->nrefs == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        const char **nr = realloc(f->refs, cap * sizeof *nr);
        if (!nr) {
            f->oom = 1;
            return;
        }
        f->refs = nr;
        f->cap = cap;
    }
    f->refs[f->nrefs++] = name;
}

static void store(sframe *f, char *name, int in_if) {
    if (has_ref(f, name)) return;
    if (!in_if && !ancestor_ref(f->parent, name)) {
        char **nu = realloc(*f->undef, (*f->nundef + 1) * sizeof *nu);
        if (!nu) {
            f->oom = 1;
            return;
        }
        *f->undef = nu;
        nu[(*f->nundef)++] = name;
    }
    add_ref(f, name);
}

static void add_kid(sframe *f, tnode *n) {
    if (f->nkids == f->kcap) {
        size_t cap = f->kcap ? f->kcap * 2 : 8;
        tnode **nk = realloc(f->kids, cap * sizeof *nk);
        if (!nk) {
            f->oom = 1;
            return;
        }
        f->kids = nk;
        f->kcap = cap;
    }
    f->kids[f->nkids++] = n;
}

/* Reads of an expression (its tree height is bounded by the parser). */
static void visit_expr(sframe *f, const tnode *e) {
    if (!e) return;
    if (e->type == N_NAME) {
        add_ref(f, e->name);
        return;
    }
    visit_expr(f, e->a);
    visit_expr(f, e->b);
    visit_expr(f, e->c);
    visit_expr(f, e->d);
    for (size_t i = 0; i < e->l1.n; i++) visit_expr(f, e->l1.v[i]);
    for (size_t i = 0; i < e->l2.n; i++) visit_expr(f, e->l2.v[i]);
}

static void visit_body(sframe *f, const tnode_list *body, int in_if);

static void visit_stmt(sframe *f, tnode *s, int in_if) {
    switch (s->type) {
    case S_OUTPUT: visit_expr(f, s->a); break;
    case S_IF:
        visit_expr(f, s->a);
        visit_body(f, &s->l1, 1);
        visit_body(f, &s->l2, 1);
        break;
    case S_FOR:
        visit_expr(f, s->a);
        add_kid(f, s);
        break;
    case S_SET:
        visit_expr(f, s->b);
        if (s->a) visit_expr(f, s->a->a);   /* ns.x = ...: reads ns */
        else
            for (size_t i = 0; i < s->nnames; i++) store(f, s->names[i], in_if);
        break;
    case S_SETBLOCK:
        store(f, s->names[0], in_if);
        add_kid(f, s);
        break;
    case S_MACRO:
        store(f, s->name, in_if);
        add_kid(f, s);
        break;
    case S_FILTERBLOCK:
        for (size_t i = 0; i < s->l2.n; i++) visit_expr(f, s->l2.v[i]);
        add_kid(f, s);
        break;
    case S_CALLBLOCK:
        visit_expr(f, s->a);
        add_kid(f, s);
        break;
    case S_WITH:
        for (size_t i = 0; i < s->l2.n; i++) visit_expr(f, s->l2.v[i]);
        add_kid(f, s);
        break;
    case S_BLOCK: add_kid(f, s); break;
    default: break;
    }
}

static void visit_body(sframe *f, const tnode_list *body, int in_if) {
    for (size_t i = 0; i < body->n; i++) visit_stmt(f, body->v[i], in_if);
}

static int analyse(const sframe *parent, tnode *scope, const tnode_list *body, char ***undef,
                   size_t *nundef, int depth);

/* The frame of a nested scope node: its parameters, then its statements. */
static int analyse_kid(const sframe *parent, tnode *k, int depth) {
    return analyse(parent, k, k->type == S_MACRO ? &k->l2 : &k->l1, &k->undef, &k->nundef, depth);
}

static int analyse(const sframe *parent, tnode *scope, const tnode_list *body, char ***undef,
                   size_t *nundef, int depth) {
    if (depth > 400) return 0;   /* statement nesting is bounded by the parser already */
    sframe f = {.parent = parent, .undef = undef, .nundef = nundef};
    if (scope) {
        for (size_t i = 0; scope->type != S_SETBLOCK && i < scope->nnames; i++)
            add_ref(&f, scope->names[i]);
        if (scope->type == S_FOR) {
            add_ref(&f, "loop");
            visit_expr(&f, scope->b);
        } else if (scope->type == S_MACRO) {
            add_ref(&f, "caller");
            for (size_t i = 0; i < scope->l1.n; i++) visit_expr(&f, scope->l1.v[i]);
        } else if (scope->type == S_SETBLOCK) {
            for (size_t i = 0; i < scope->l2.n; i++) visit_expr(&f, scope->l2.v[i]);
        }
    }
    visit_body(&f, body, 0);
    int rc = f.oom ? SPECD_ENOMEM : 0;
    for (size_t i = 0; !rc && i < f.nkids; i++) rc = analyse_kid(&f, f.kids[i], depth + 1);
    free(f.refs);
    free(f.kids);
    return rc;
}

int tmpl_analyse_scopes(tnode_list *body, char ***root_undef, size_t *nroot_undef) {
    *root_undef = NULL;
    *nroot_undef = 0;
    return analyse(NULL, NULL, body, root_undef, nroot_undef, 0);
}
