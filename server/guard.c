/* Connection guard: receive deadlines and the connection cap (see guard.h). */
#include "server/guard.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include "server/cli.h"
#include "server/log.h"

struct guard_conn {
    int fd;
    int receiving;         /* waiting for (the rest of) a request */
    int shut;              /* shut down by the watchdog already */
    double since;          /* when the current receive began */
    guard_conn *prev, *next;
};

struct guard {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int stop, started;
    double recv_timeout;
    int max_connections, n_open;
    guard_conn *head;
};

/* Once a second (a deadline is met to within a second): shut down late receivers. */
static void *watchdog(void *arg) {
    guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        pthread_cond_timedwait(&g->cv, &g->mu, &until);
        double t = cli_now_s();
        for (guard_conn *c = g->head; c && !g->stop; c = c->next) {
            if (!c->receiving || c->shut || t - c->since <= g->recv_timeout) continue;
            c->shut = 1;
            shutdown(c->fd, SHUT_RDWR);
            log_msg(LOG_DEBUG, "connection closed: no whole request within %.0fs", g->recv_timeout);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

guard *guard_create(double recv_timeout, int max_connections) {
    guard *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->recv_timeout = recv_timeout;
    g->max_connections = max_connections;
    if (recv_timeout > 0) {
        if (pthread_create(&g->thread, NULL, watchdog, g)) {
            guard_destroy(g);
            return NULL;
        }
        g->started = 1;
    }
    return g;
}

void guard_destroy(guard *g) {
    if (!g) return;
    if (g->started) {
        pthread_mutex_lock(&g->mu);
        g->stop = 1;
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->thread, NULL);
    }
    for (guard_conn *c = g->head, *n; c; c = n) n = c->next, free(c);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

guard_conn *guard_open(guard *g, int fd) {
    guard_conn *c = calloc(1, sizeof *c);
    pthread_mutex_lock(&g->mu);
    g->n_open++;
    if (c) {
        c->fd = fd;
        c->receiving = 1;
        c->since = cli_now_s();
        c->next = g->head;
        if (g->head) g->head->prev = c;
        g->head = c;
    }
    pthread_mutex_unlock(&g->mu);
    return c;
}

void guard_close(guard *g, guard_conn *c) {
    pthread_mutex_lock(&g->mu);
    g->n_open--;
    if (c) {
        if (c->prev) c->prev->next = c->next;
        else g->head = c->next;
        if (c->next) c->next->prev = c->prev;
    }
    pthread_mutex_unlock(&g->mu);
    free(c);
}

void guard_received(guard *g, guard_conn *c) {
    if (!c) return;
    pthread_mutex_lock(&g->mu);
    c->receiving = 0;
    pthread_mutex_unlock(&g->mu);
}

void guard_replied(guard *g, guard_conn *c) {
    if (!c) return;
    pthread_mutex_lock(&g->mu);
    c->receiving = 1;
    c->since = cli_now_s();
    pthread_mutex_unlock(&g->mu);
}

int guard_over_cap(guard *g) {
    pthread_mutex_lock(&g->mu);
    int over = g->max_connections > 0 && g->n_open > g->max_connections;
    pthread_mutex_unlock(&g->mu);
    return over;
}
