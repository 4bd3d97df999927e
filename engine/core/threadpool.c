/* Fork-join thread pool; see threadpool.h. Workers sleep on a condition variable between
 * jobs (the CPU runner issues a few dozen jobs per layer, so wake-up latency matters less
 * than not burning a core while the server is idle). */
#include "engine/core/threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct tp_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    unsigned long generation;   /* bumped per job; workers wait for a new one */
    int shutdown;
    int busy;                   /* workers still inside the current job */
    tp_fn fn;
    void *ctx;
    int n;
    atomic_int next;
};

static void run_tasks(tp_pool *p) {
    for (;;) {
        int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        p->fn(p->ctx, i);
    }
}

static void *worker(void *arg) {
    tp_pool *p = arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->shutdown && p->generation == seen) pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->shutdown) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

tp_pool *tp_create(int n_threads) {
    tp_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    if (n_threads < 1) n_threads = 1;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) goto fail;
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
            p->n_threads = i;   /* run with what started */
            break;
        }
    }
    return p;
fail:
    free(p);
    return NULL;
}

void tp_destroy(tp_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->shutdown = 1;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    free(p->threads);
    free(p);
}

int tp_threads(const tp_pool *p) { return p->n_threads; }

void tp_run(tp_pool *p, tp_fn fn, void *ctx, int n) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        for (int i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    atomic_store(&p->next, 0);
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
