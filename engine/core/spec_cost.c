/* The speculation cost model; see spec_cost.h. */
#include "engine/core/spec_cost.h"

#include <stdlib.h>

/* Linear interpolation through (x0, y0), (x1, y1) at x (extrapolates outside). */
static double lerp(double x0, double y0, double x1, double y1, double x) {
    return x1 == x0 ? y0 : y0 + (y1 - y0) * (x - x0) / (x1 - x0);
}

/* Time of measured batch row bi at average draft length kf. */
static double at_k(const spec_cost *c, int bi, double kf) {
    if (c->n_k == 1) return c->t[bi][0];
    int j = 0;
    while (j + 2 < c->n_k && kf > c->k[j + 1]) j++;
    return lerp(c->k[j], c->t[bi][j], c->k[j + 1], c->t[bi][j + 1], kf);
}

/* The measured table, interpolated (no learned scale). */
static double table_step(const spec_cost *c, int rows, int extra) {
    if (c->n_b == 0 || rows < 1) return 1.0;
    double kf = (double)extra / rows;
    if (c->n_b == 1) return at_k(c, 0, kf) * rows / c->b[0];
    int i = 0;
    while (i + 2 < c->n_b && rows > c->b[i + 1]) i++;
    double t = lerp(c->b[i], at_k(c, i, kf), c->b[i + 1], at_k(c, i + 1, kf), rows);
    return t > 0 ? t : 1e-9;
}

/* Index of the measured batch size nearest to rows. */
static int nearest_b(const spec_cost *c, int rows) {
    int bi = 0;
    for (int i = 1; i < c->n_b; i++)
        if (abs(c->b[i] - rows) < abs(c->b[bi] - rows)) bi = i;
    return bi;
}

double spec_cost_step(const spec_cost *c, int rows, int extra) {
    double t = table_step(c, rows, extra);
    if (extra <= 0 || c->n_b == 0 || rows < 1) return t;
    double s = c->scale[nearest_b(c, rows)], t0 = table_step(c, rows, 0);
    return s > 0 && t > t0 ? t0 + (t - t0) * s : t;
}

void spec_cost_observe(spec_cost *c, int rows, int extra, double seconds) {
    if (c->n_b == 0 || rows < 1 || extra <= 0 || !(seconds > 0)) return;
    double t0 = table_step(c, rows, 0), tp = table_step(c, rows, extra);
    if (!(tp > t0)) return;
    double need = (seconds - t0) / (tp - t0);
    int bi = nearest_b(c, rows);
    double s = c->scale[bi] > 0 ? c->scale[bi] : 1.0;
    /* one observation moves the scale by at most 1.3x either way: a single slow step (a
     * first pass of a shape, a host hiccup) must not price speculation out for good, as
     * then no step would speculate to correct it (the probes are priced by it too) */
    need = need < 0.5 * s ? 0.5 * s : need > 2 * s ? 2 * s : need;
    need = need < 0.25 ? 0.25 : need > 50 ? 50 : need;
    c->scale[bi] = 0.7 * s + 0.3 * need;
}

double spec_cost_spec_step(const spec_cost *c, int rows, int extra) {
    return spec_cost_step(c, rows, extra) + (c->n_b ? SPEC_COST_HOST_STEPS * c->host[nearest_b(c, rows)] : 0);
}

double spec_cost_observe_host(spec_cost *c, int rows, double seconds) {
    if (c->n_b == 0 || rows < 1) return 0;
    double *h = &c->host[nearest_b(c, rows)];
    if (seconds >= 0) *h = 0.9 * *h + 0.1 * (seconds < 0.1 ? seconds : 0.1);
    return *h;
}

static int cand_cmp(const void *a, const void *b) {
    const spec_cost_cand *x = a, *y = b;
    if (x->gain != y->gain) return x->gain < y->gain ? 1 : -1;
    if (x->j != y->j) return x->j - y->j;   /* a row's drafts in order, also on equal gains */
    return x->row - y->row;
}

int spec_cost_choose(const spec_cost *c, int rows, int extra, const int *avail, const float *alpha,
                     int *k_out, spec_cost_cand *cand) {
    int nc = 0;
    for (int i = 0; i < rows; i++) {
        k_out[i] = 0;
        double g = 1;
        for (int j = 1; j <= avail[i]; j++) {
            g *= alpha[i];
            cand[nc++] = (spec_cost_cand){.gain = (float)g, .row = i, .j = j};
        }
    }
    if (nc == 0) return 0;
    qsort(cand, (size_t)nc, sizeof *cand, cand_cmp);
    /* value of taking the best m candidates; keep the best m (the smallest on ties), and
     * speculate only when that beats the plain step by SPEC_COST_MIN_GAIN */
    double out = rows, best = out / spec_cost_step(c, rows, extra) * (1 + SPEC_COST_MIN_GAIN);
    int best_m = 0;
    for (int m = 1; m <= nc; m++) {
        out += cand[m - 1].gain;
        double v = out / spec_cost_spec_step(c, rows, extra + m);
        if (v > best * (1 + 1e-9)) {
            best = v;
            best_m = m;
        }
    }
    for (int m = 0; m < best_m; m++) k_out[cand[m].row]++;
    return best_m;
}

double spec_cost_expected(double a, int k) {
    double g = 1, s = 0;
    for (int j = 0; j < k; j++) s += (g *= a);
    return s;
}

int spec_cost_uniform_k(const spec_cost *c, int rows, const int *avail, const float *alpha) {
    int K = 0, best_k = 0;
    for (int j = 0; j < rows; j++)
        if (avail[j] > K) K = avail[j];
    double best = rows / spec_cost_step(c, rows, 0) * (1 + SPEC_COST_MIN_GAIN);
    for (int k = 1; k <= K; k++) {
        double gain = 0;
        for (int j = 0; j < rows; j++) gain += spec_cost_expected(alpha[j], avail[j] < k ? avail[j] : k);
        double v = (rows + gain) / spec_cost_spec_step(c, rows, rows * k);
        if (v > best) {
            best = v;
            best_k = k;
        }
    }
    return best_k;
}

int spec_cost_draft_pays(const spec_cost *c, int rows, int extra, int k, double a) {
    const double plain = rows / spec_cost_step(c, rows, extra);
    return rows * (1 + spec_cost_expected(a, k)) / spec_cost_spec_step(c, rows, extra + rows * k) >
           plain * (1 + SPEC_COST_MIN_GAIN);
}

double spec_cost_break_even(const spec_cost *c, int rows, int max_k, spec_cost_cand *cand, int *k_out,
                            int *avail, float *alpha) {
    for (int step = 0; step <= 20; step++) {
        float a = 0.05f * (float)step;
        for (int i = 0; i < rows; i++) {
            avail[i] = max_k;
            alpha[i] = a;
        }
        if (spec_cost_choose(c, rows, 0, avail, alpha, k_out, cand) > 0) return a;
    }
    return 1.05;
}
