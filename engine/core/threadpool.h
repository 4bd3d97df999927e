/* A tiny fork-join thread pool (prefix tp_) for the CPU runner: tp_run(fn, ctx, n) calls
 * fn(ctx, i) for i in [0, n) spread over the workers and the calling thread, and returns
 * when all are done. Tasks are handed out by an atomic counter so uneven tasks balance.
 * One caller at a time. */
#ifndef SPECD_THREADPOOL_H
#define SPECD_THREADPOOL_H

typedef struct tp_pool tp_pool;
typedef void (*tp_fn)(void *ctx, int i);

/* n_threads total including the caller (1 = run inline). */
tp_pool *tp_create(int n_threads);
void tp_destroy(tp_pool *p);
int tp_threads(const tp_pool *p);
void tp_run(tp_pool *p, tp_fn fn, void *ctx, int n);

#endif
