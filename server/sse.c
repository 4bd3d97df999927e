/* Response channel with park/wake hooks: see sse.h for the ordering argument. */
#include "server/sse.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"

/* unread bytes over all channels (for the server's total output-buffer cap) */
static _Atomic long long total_unread;

struct sse_chan {
    pthread_mutex_t mu;
    int refs;
    char *buf;
    size_t head, len, cap;   /* unread bytes are buf[head, head + len) */
    int closed, status;
    int parked, detached;
    sse_hook park, wake;
    void *arg;
};

sse_chan *sse_chan_new(void) {
    sse_chan *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 1;
    c->status = 200;
    return c;
}

void sse_chan_ref(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
}

void sse_chan_unref(sse_chan *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (!last) return;
    atomic_fetch_sub(&total_unread, (long long)c->len);
    pthread_mutex_destroy(&c->mu);
    free(c->buf);
    free(c);
}

void sse_chan_bind(sse_chan *c, sse_hook park, sse_hook wake, void *arg) {
    pthread_mutex_lock(&c->mu);
    c->park = park;
    c->wake = wake;
    c->arg = arg;
    pthread_mutex_unlock(&c->mu);
}

/* Called with the lock held. */
static void wake_locked(sse_chan *c) {
    if (c->parked && !c->detached) {
        c->parked = 0;
        if (c->wake) c->wake(c->arg);
    }
}

/* Append with the lock held; wakes the reader unless told not to. */
static int push_locked(sse_chan *c, const void *data, size_t len, int wake) {
    int rc = 0;
    if (c->detached || c->closed) {
        rc = c->detached ? SPECD_ECANCELED : SPECD_ESTATE;
        goto out;
    }
    if (c->head && c->head + c->len + len > c->cap) {  /* compact before growing */
        memmove(c->buf, c->buf + c->head, c->len);
        c->head = 0;
    }
    if (c->len + len > c->cap) {
        size_t cap = c->cap ? c->cap : 4096;
        while (cap < c->len + len) cap *= 2;
        char *nb = realloc(c->buf, cap);
        if (!nb) {
            rc = SPECD_ENOMEM;
            goto out;
        }
        c->buf = nb;
        c->cap = cap;
    }
    memcpy(c->buf + c->head + c->len, data, len);
    c->len += len;
    atomic_fetch_add(&total_unread, (long long)len);
    if (wake) wake_locked(c);
out:
    return rc;
}

int sse_chan_push(sse_chan *c, const void *data, size_t len) {
    pthread_mutex_lock(&c->mu);
    int rc = push_locked(c, data, len, 1);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int sse_chan_push_close(sse_chan *c, const void *data, size_t len, int status) {
    pthread_mutex_lock(&c->mu);
    int rc = push_locked(c, data, len, 0);
    if (!c->closed) {
        c->closed = 1;
        c->status = status;
        wake_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void sse_chan_close(sse_chan *c, int status) {
    pthread_mutex_lock(&c->mu);
    if (!c->closed) {
        c->closed = 1;
        c->status = status;
        wake_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
}

ssize_t sse_chan_pull(sse_chan *c, void *buf, size_t max) {
    ssize_t n;
    pthread_mutex_lock(&c->mu);
    if (c->len) {
        n = (ssize_t)(c->len < max ? c->len : max);
        memcpy(buf, c->buf + c->head, (size_t)n);
        c->head += (size_t)n;
        c->len -= (size_t)n;
        atomic_fetch_sub(&total_unread, (long long)n);
        if (!c->len) c->head = 0;
    } else if (c->closed) {
        n = -1;
    } else {
        n = 0;
        if (c->park && !c->parked && !c->detached) {
            c->parked = 1;
            c->park(c->arg);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return n;
}

int sse_chan_take_if_closed(sse_chan *c, char **data, size_t *len, int *status) {
    int done = 0;
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        done = 1;
        *status = c->status;
        *len = c->len;
        *data = NULL;
        atomic_fetch_sub(&total_unread, (long long)c->len);
        if (c->len) {
            if (c->head) memmove(c->buf, c->buf + c->head, c->len);
            *data = c->buf;
            c->buf = NULL;
            c->cap = c->len = c->head = 0;
        }
    } else if (c->park && !c->parked && !c->detached) {
        c->parked = 1;
        c->park(c->arg);
    }
    pthread_mutex_unlock(&c->mu);
    return done;
}

void sse_chan_detach(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    c->detached = 1;
    c->parked = 0;
    pthread_mutex_unlock(&c->mu);
}

int sse_chan_detached(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    int d = c->detached;
    pthread_mutex_unlock(&c->mu);
    return d;
}

int sse_chan_closed(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    int d = c->closed;
    pthread_mutex_unlock(&c->mu);
    return d;
}

size_t sse_chan_unread(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    size_t n = c->len;
    pthread_mutex_unlock(&c->mu);
    return n;
}

size_t sse_total_unread(void) {
    long long n = atomic_load(&total_unread);
    return n > 0 ? (size_t)n : 0;
}

void sse_chan_discard(sse_chan *c) {
    pthread_mutex_lock(&c->mu);
    atomic_fetch_sub(&total_unread, (long long)c->len);
    free(c->buf);
    c->buf = NULL;
    c->head = c->len = c->cap = 0;
    pthread_mutex_unlock(&c->mu);
}
