/* Tensor-parallel launcher, TCP rendezvous, socket broadcast and watchdog (see tp.h).
 *
 * Wire format (all integers little-endian, fixed-size fields; encoded byte by byte so
 * hosts of any endianness agree):
 *   hello  (rank k -> 0): u32 magic "SPTP" | u32 version | u32 world | u32 nnodes | u32 rank
 *   answer (0 -> rank k): u32 magic | u32 version | i32 status | char msg[116] | uid[128]
 *   bcast  (0 -> all)   : u32 magic "SPBC" | u32 seq | u64 n | n bytes
 * A status != 0 in the answer carries rank 0's message; both sides then fail. */
#include "engine/tp/tp.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/err.h"

extern char **environ;

#define TP_MAGIC 0x50545053u   /* "SPTP" */
#define TP_BC_MAGIC 0x43425053u /* "SPBC" */
#define TP_AR_MAGIC 0x52415053u /* "SPAR" */
#define TP_VERSION 2u   /* 2: window-pool tables and sizes in the runner ops */
#define HELLO_BYTES 20
#define MSG_BYTES 116
#define ANSWER_BYTES (12 + MSG_BYTES + TP_UID_BYTES)

/* ---- config -------------------------------------------------------------------------- */

void tp_config_defaults(tp_config *c) {
    if (c->world_size <= 0) c->world_size = 1;
    if (c->nnodes <= 0) c->nnodes = 1;
    if (!c->master_addr[0]) snprintf(c->master_addr, sizeof c->master_addr, "127.0.0.1");
    if (c->master_port <= 0) c->master_port = TP_DEFAULT_PORT;
    if (c->timeout_ms <= 0) c->timeout_ms = 300000;
    if (c->world_size % c->nnodes == 0 && c->rank == 0 && c->local_rank == 0)
        c->rank = c->node_rank * (c->world_size / c->nnodes);
}

int tp_config_check(const tp_config *c, char *err, size_t errlen) {
    if (c->world_size < 1 || c->world_size > TP_MAX_WORLD)
        return specd_errf(err, errlen, SPECD_EINVAL, "--tensor-parallel-size %d: must be 1..%d",
                          c->world_size, TP_MAX_WORLD);
    if (c->nnodes < 1 || c->world_size % c->nnodes)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--nnodes %d must divide --tensor-parallel-size %d", c->nnodes, c->world_size);
    if (c->node_rank < 0 || c->node_rank >= c->nnodes)
        return specd_errf(err, errlen, SPECD_EINVAL, "--node-rank %d: must be 0..%d", c->node_rank,
                          c->nnodes - 1);
    if (c->master_port < 1 || c->master_port > 65535)
        return specd_errf(err, errlen, SPECD_EINVAL, "--master-port %d: must be 1..65535", c->master_port);
    if (c->rank < 0 || c->rank >= c->world_size || c->local_rank < 0 ||
        c->local_rank >= tp_nproc_per_node(c))
        return specd_errf(err, errlen, SPECD_EINVAL, "tensor-parallel rank %d (local %d) out of range",
                          c->rank, c->local_rank);
    return 0;
}

static int env_int(const char *name, int *out, char *err, size_t errlen) {
    const char *s = getenv(name);
    if (!s || !*s) return specd_errf(err, errlen, SPECD_EINVAL, "%s is not set", name);
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < 0 || v > 1 << 20)
        return specd_errf(err, errlen, SPECD_EINVAL, "%s=%s is not a non-negative integer", name, s);
    *out = (int)v;
    return 0;
}

int tp_config_from_env(tp_config *c, char *err, size_t errlen) {
    const char *r = getenv("SPECD_TP_RANK");
    if (!r || !*r) return 0;
    int rc;
    if ((rc = env_int("SPECD_TP_RANK", &c->rank, err, errlen)) ||
        (rc = env_int("SPECD_TP_LOCAL_RANK", &c->local_rank, err, errlen)) ||
        (rc = env_int("SPECD_TP_WORLD", &c->world_size, err, errlen)) ||
        (rc = env_int("SPECD_TP_NNODES", &c->nnodes, err, errlen)))
        return rc;
    const char *m = getenv("SPECD_TP_MASTER"), *colon = m ? strrchr(m, ':') : NULL;
    if (!colon || colon == m || (size_t)(colon - m) >= sizeof c->master_addr)
        return specd_errf(err, errlen, SPECD_EINVAL, "SPECD_TP_MASTER=%s is not host:port", m ? m : "");
    memcpy(c->master_addr, m, (size_t)(colon - m));
    c->master_addr[colon - m] = 0;
    c->master_port = atoi(colon + 1);
    if (c->nnodes < 1 || c->world_size % c->nnodes) return specd_errf(err, errlen, SPECD_EINVAL, "bad SPECD_TP_NNODES");
    c->node_rank = c->rank / tp_nproc_per_node(c);
    if ((rc = tp_config_check(c, err, errlen))) return rc;
    return 1;
}

int tp_set_nccl_env(void) { return setenv("NCCL_NVLS_ENABLE", "0", 1) ? SPECD_EINVAL : 0; }

/* ---- local launcher ------------------------------------------------------------------ */

struct tp_children {
    int n;
    pid_t pid[TP_MAX_WORLD];
    int rank[TP_MAX_WORLD];
    int done[TP_MAX_WORLD];    /* reaped */
    int status[TP_MAX_WORLD];  /* waitpid status once done */
};

int tp_children_count(const tp_children *ch) { return ch ? ch->n : 0; }
pid_t tp_children_pid(const tp_children *ch, int i) { return ch && i >= 0 && i < ch->n ? ch->pid[i] : -1; }

static void describe(int status, char *why, size_t n) {
    if (WIFEXITED(status)) snprintf(why, n, "exit %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(why, n, "signal %d", WTERMSIG(status));
    else snprintf(why, n, "status %d", status);
}

/* envp for a child: ours minus the keys we set, plus ours. Built before fork because
 * setenv is not async-signal-safe in a threaded parent. */
static char **child_env(const tp_config *c, int rank, int local_rank) {
    static const char *keys[] = {"SPECD_TP_RANK=", "SPECD_TP_LOCAL_RANK=", "SPECD_TP_WORLD=",
                                 "SPECD_TP_NNODES=", "SPECD_TP_MASTER=", "NCCL_NVLS_ENABLE="};
    size_t n = 0;
    while (environ && environ[n]) n++;
    char **env = calloc(n + 8, sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int ours = 0;
        for (size_t j = 0; j < sizeof keys / sizeof keys[0]; j++)
            if (!strncmp(environ[i], keys[j], strlen(keys[j]))) ours = 1;
        if (!ours) env[k++] = environ[i];
    }
    char buf[6][320];
    snprintf(buf[0], sizeof buf[0], "SPECD_TP_RANK=%d", rank);
    snprintf(buf[1], sizeof buf[1], "SPECD_TP_LOCAL_RANK=%d", local_rank);
    snprintf(buf[2], sizeof buf[2], "SPECD_TP_WORLD=%d", c->world_size);
    snprintf(buf[3], sizeof buf[3], "SPECD_TP_NNODES=%d", c->nnodes);
    snprintf(buf[4], sizeof buf[4], "SPECD_TP_MASTER=%s:%d", c->master_addr, c->master_port);
    snprintf(buf[5], sizeof buf[5], "NCCL_NVLS_ENABLE=0");
    for (int j = 0; j < 6; j++)
        if (!(env[k++] = strdup(buf[j]))) return env;  /* caller frees the 6 strdup'd tail */
    return env;
}

static void free_child_env(char **env) {
    if (!env) return;
    size_t n = 0;
    while (env[n]) n++;
    for (size_t i = n >= 6 ? n - 6 : 0; i < n; i++) free(env[i]);
    free(env);
}

tp_children *tp_spawn_local(const tp_config *c, const char *exe, char *const argv[], char *err,
                            size_t errlen) {
    if (tp_config_check(c, err, errlen)) return NULL;
    if (!argv || !argv[0]) {
        specd_errf(err, errlen, SPECD_EINVAL, "tp_spawn_local: empty argv");
        return NULL;
    }
    char self[4096];
    if (!exe) {
        ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
        if (k <= 0) {
            specd_errf(err, errlen, SPECD_EIO, "cannot resolve /proc/self/exe: %s", strerror(errno));
            return NULL;
        }
        self[k] = 0;
        exe = self;
    }
    tp_children *ch = calloc(1, sizeof *ch);
    if (!ch) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    int nproc = tp_nproc_per_node(c), base = c->node_rank * nproc;
    pid_t parent = getpid();
    for (int lr = 1; lr < nproc; lr++) {
        char **env = child_env(c, base + lr, lr);
        if (!env) {
            specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
            goto fail;
        }
        pid_t pid = fork();
        if (pid == 0) {
            /* Die with the launcher: no orphaned GPU workers after a crash of rank 0. */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(126);
            execve(exe, argv, env);
            _exit(127);
        }
        free_child_env(env);
        if (pid < 0) {
            specd_errf(err, errlen, SPECD_EIO, "fork for rank %d: %s", base + lr, strerror(errno));
            goto fail;
        }
        ch->pid[ch->n] = pid;
        ch->rank[ch->n] = base + lr;
        ch->n++;
    }
    return ch;
fail:
    tp_children_free(ch);
    return NULL;
}

/* Child i has ended (reaped now; one someone else reaped counts as a clean exit)? */
static int reap_one(tp_children *ch, int i) {
    int st;
    pid_t p = waitpid(ch->pid[i], &st, WNOHANG);
    if (p != ch->pid[i] && !(p < 0 && errno == ECHILD)) return 0;
    ch->done[i] = 1;
    ch->status[i] = p == ch->pid[i] ? st : 0;
    return 1;
}

int tp_children_poll(tp_children *ch, int *rank, char *why, size_t whylen) {
    for (int i = 0; ch && i < ch->n; i++) {
        if (ch->done[i] || !reap_one(ch, i)) continue;
        if (rank) *rank = ch->rank[i];
        if (why) describe(ch->status[i], why, whylen);
        return 1;
    }
    return 0;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Reap the children that have ended; returns how many still run. */
static int reap(tp_children *ch) {
    int left = 0;
    for (int i = 0; i < ch->n; i++) left += !ch->done[i] && !reap_one(ch, i);
    return left;
}

/* 1 if any ended child did not exit with status 0. */
static int any_unclean(const tp_children *ch) {
    for (int i = 0; i < ch->n; i++)
        if (ch->done[i] && !(WIFEXITED(ch->status[i]) && WEXITSTATUS(ch->status[i]) == 0)) return 1;
    return 0;
}

int tp_children_stop(tp_children *ch, int grace_ms) {
    if (!ch) return 0;
    for (int i = 0; i < ch->n; i++)
        if (!ch->done[i]) kill(ch->pid[i], SIGTERM);
    int64_t deadline = now_ms() + (grace_ms > 0 ? grace_ms : 0);
    int killed = 0;   /* a child that needed SIGKILL never counts as a clean exit */
    while (reap(ch)) {
        if (now_ms() >= deadline) {
            for (int i = 0; i < ch->n; i++)
                if (!ch->done[i]) {
                    kill(ch->pid[i], SIGKILL);
                    waitpid(ch->pid[i], &ch->status[i], 0);
                    ch->done[i] = 1;
                    killed = 1;
                }
            break;
        }
        usleep(10000);
    }
    return killed || any_unclean(ch);
}

int tp_children_wait(tp_children *ch, int timeout_ms) {
    if (!ch) return 0;
    int64_t deadline = now_ms() + timeout_ms;
    while (reap(ch)) {
        if (now_ms() >= deadline) return SPECD_ETIMEOUT;
        usleep(5000);
    }
    return any_unclean(ch);
}

void tp_children_free(tp_children *ch) {
    if (!ch) return;
    tp_children_stop(ch, 2000);
    free(ch);
}

/* ---- sockets ------------------------------------------------------------------------- */

struct tp_comm {
    int rank, world;
    int fd[TP_MAX_WORLD];  /* rank 0: fd[k] is rank k's socket; others: fd[0] is rank 0 */
    uint32_t seq;
    float *ar;             /* rank 0: one peer's partial during tp_allreduce_sum_f32 */
    size_t ar_cap;
    char err[256];
};

static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* Wait for fd to be ready for `ev` until deadline (ms, monotonic; < 0: forever). */
static int wait_fd(int fd, short ev, int64_t deadline) {
    for (;;) {
        int tmo = deadline < 0 ? -1 : (int)(deadline - now_ms());
        if (deadline >= 0 && tmo <= 0) return SPECD_ETIMEOUT;
        struct pollfd p = {fd, ev, 0};
        int k = poll(&p, 1, tmo);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return SPECD_EIO;
        if (k == 0) continue;
        return 0;
    }
}

/* Full send / receive with a deadline. 0, SPECD_ETIMEOUT, or SPECD_EIO (closed / error). */
static int send_all(int fd, const void *buf, size_t n, int64_t deadline) {
    const uint8_t *p = buf;
    while (n) {
        int rc = wait_fd(fd, POLLOUT, deadline);
        if (rc) return rc;
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) return SPECD_EIO;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int recv_all(int fd, void *buf, size_t n, int64_t deadline) {
    uint8_t *p = buf;
    while (n) {
        int rc = wait_fd(fd, POLLIN, deadline);
        if (rc) return rc;
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) return SPECD_EIO;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Keepalive bounds how long a dead host (no FIN ever arrives) goes unnoticed: ~11 s. */
static void tune_socket(int fd) {
    int one = 1, idle = 5, intvl = 2, cnt = 3;
    unsigned tmo = 15000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &tmo, sizeof tmo);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static struct addrinfo *resolve(const tp_config *c, int passive, char *err, size_t errlen) {
    char port[16];
    snprintf(port, sizeof port, "%d", c->master_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0}, *ai = NULL;
    int g = getaddrinfo(c->master_addr, port, &hints, &ai);
    if (g) {
        specd_errf(err, errlen, SPECD_EINVAL, "--master-addr %s: %s", c->master_addr, gai_strerror(g));
        return NULL;
    }
    return ai;
}

static tp_comm *comm_new(const tp_config *c) {
    tp_comm *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->rank = c->rank;
    t->world = c->world_size;
    for (int i = 0; i < TP_MAX_WORLD; i++) t->fd[i] = -1;
    return t;
}

static void answer(int fd, int status, const char *msg, const uint8_t *uid, int64_t deadline) {
    uint8_t a[ANSWER_BYTES] = {0};
    put32(a, TP_MAGIC);
    put32(a + 4, TP_VERSION);
    put32(a + 8, (uint32_t)status);
    snprintf((char *)a + 12, MSG_BYTES, "%s", msg ? msg : "");
    if (uid) memcpy(a + 12 + MSG_BYTES, uid, TP_UID_BYTES);
    send_all(fd, a, sizeof a, deadline);
}

static int peer_name(int fd, char *buf, size_t n) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[128] = "?", serv[16] = "?";
    if (!getpeername(fd, (struct sockaddr *)&ss, &sl))
        getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    return snprintf(buf, n, "%s:%s", host, serv);
}

/* Rank 0: accept world-1 peers, check their hellos, then send everyone the uid. */
static tp_comm *rendezvous_master(const tp_config *c, const uint8_t *uid, char *err, size_t errlen) {
    int64_t deadline = now_ms() + c->timeout_ms;
    tp_comm *t = comm_new(c);
    struct addrinfo *ai = resolve(c, 1, err, errlen);
    int lfd = -1, joined = 0;
    char who[160], msg[MSG_BYTES];
    if (!t || !ai) goto fail;
    for (struct addrinfo *p = ai; p && lfd < 0; p = p->ai_next) {
        lfd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
        if (lfd < 0) continue;
        int one = 1;
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(lfd, p->ai_addr, p->ai_addrlen) || listen(lfd, TP_MAX_WORLD)) {
            close(lfd);
            lfd = -1;
        }
    }
    if (lfd < 0) {
        specd_errf(err, errlen, SPECD_EIO, "rank 0 cannot listen on %s:%d: %s (--master-addr / --master-port)",
                   c->master_addr, c->master_port, strerror(errno));
        goto fail;
    }
    while (joined < c->world_size - 1) {
        int rc = wait_fd(lfd, POLLIN, deadline);
        if (rc) {
            int o = snprintf(err, errlen, "tensor-parallel rendezvous on %s:%d timed out after %d ms; missing ranks:",
                             c->master_addr, c->master_port, c->timeout_ms);
            for (int k = 1; k < c->world_size && err && o > 0 && (size_t)o < errlen; k++)
                if (t->fd[k] < 0) o += snprintf(err + o, errlen - (size_t)o, " %d", k);
            goto fail;
        }
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        tune_socket(fd);
        peer_name(fd, who, sizeof who);
        uint8_t h[HELLO_BYTES];
        if (recv_all(fd, h, sizeof h, deadline) || get32(h) != TP_MAGIC) {
            close(fd);   /* a stray connection (port scan, health check): ignore it */
            continue;
        }
        uint32_t ver = get32(h + 4), world = get32(h + 8), nnodes = get32(h + 12), rank = get32(h + 16);
        msg[0] = 0;
        if (ver != TP_VERSION)
            snprintf(msg, sizeof msg, "protocol version %u, rank 0 speaks %u", ver, TP_VERSION);
        else if ((int)world != c->world_size || (int)nnodes != c->nnodes)
            snprintf(msg, sizeof msg, "world size %u / nnodes %u, rank 0 has %d / %d", world, nnodes,
                     c->world_size, c->nnodes);
        else if (rank < 1 || (int)rank >= c->world_size)
            snprintf(msg, sizeof msg, "rank %u out of range 1..%d", rank, c->world_size - 1);
        else if (t->fd[rank] >= 0)
            snprintf(msg, sizeof msg, "rank %u joined twice", rank);
        if (msg[0]) {
            answer(fd, SPECD_EINVAL, msg, NULL, now_ms() + 1000);
            close(fd);
            specd_errf(err, errlen, SPECD_EINVAL, "tensor-parallel rendezvous: peer %s: %s", who, msg);
            goto fail;
        }
        t->fd[rank] = fd;
        joined++;
    }
    for (int k = 1; k < c->world_size; k++) answer(t->fd[k], 0, "", uid, deadline);
    close(lfd);
    freeaddrinfo(ai);
    return t;
fail:
    if (lfd >= 0) close(lfd);
    if (ai) freeaddrinfo(ai);
    if (t) {
        /* Tell whoever joined that the group is off, so no rank waits for its timeout. */
        for (int k = 1; k < c->world_size; k++)
            if (t->fd[k] >= 0) answer(t->fd[k], SPECD_EINVAL, "rank 0 aborted the rendezvous", NULL, now_ms() + 1000);
        tp_comm_close(t);
    } else if (err && !err[0]) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    }
    return NULL;
}

/* Rank k > 0: connect (retrying while rank 0 is not up yet), hello, answer. */
static tp_comm *rendezvous_worker(const tp_config *c, uint8_t *uid, char *err, size_t errlen) {
    int64_t deadline = now_ms() + c->timeout_ms;
    tp_comm *t = comm_new(c);
    struct addrinfo *ai = resolve(c, 0, err, errlen);
    int fd = -1, last = 0;
    if (!t || !ai) goto fail;
    while (fd < 0) {
        for (struct addrinfo *p = ai; p && fd < 0; p = p->ai_next) {
            fd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
            if (fd >= 0 && connect(fd, p->ai_addr, p->ai_addrlen)) {
                last = errno;
                close(fd);
                fd = -1;
            }
        }
        if (fd >= 0) break;
        if (now_ms() >= deadline) {
            specd_errf(err, errlen, SPECD_ETIMEOUT, "rank %d: cannot reach rank 0 at %s:%d within %d ms: %s",
                       c->rank, c->master_addr, c->master_port, c->timeout_ms, strerror(last));
            goto fail;
        }
        usleep(100000);
    }
    tune_socket(fd);
    t->fd[0] = fd;
    uint8_t h[HELLO_BYTES], a[ANSWER_BYTES];
    put32(h, TP_MAGIC);
    put32(h + 4, TP_VERSION);
    put32(h + 8, (uint32_t)c->world_size);
    put32(h + 12, (uint32_t)c->nnodes);
    put32(h + 16, (uint32_t)c->rank);
    int rc = send_all(fd, h, sizeof h, deadline);
    if (!rc) rc = recv_all(fd, a, sizeof a, deadline);
    if (rc) {
        specd_errf(err, errlen, rc, "rank %d: rendezvous with %s:%d: %s", c->rank, c->master_addr,
                   c->master_port, rc == SPECD_ETIMEOUT ? "rank 0 did not answer in time (are all ranks started?)"
                                                         : "connection closed by rank 0");
        goto fail;
    }
    if (get32(a) != TP_MAGIC || get32(a + 4) != TP_VERSION) {
        specd_errf(err, errlen, SPECD_EFORMAT, "rank %d: %s:%d is not a specd rank 0 (bad magic/version)",
                   c->rank, c->master_addr, c->master_port);
        goto fail;
    }
    if ((int32_t)get32(a + 8) != 0) {
        char m[MSG_BYTES + 1];
        memcpy(m, a + 12, MSG_BYTES);
        m[MSG_BYTES] = 0;
        specd_errf(err, errlen, SPECD_EINVAL, "rank %d: rank 0 refused: %s", c->rank, m);
        goto fail;
    }
    memcpy(uid, a + 12 + MSG_BYTES, TP_UID_BYTES);
    freeaddrinfo(ai);
    return t;
fail:
    if (ai) freeaddrinfo(ai);
    tp_comm_close(t);
    return NULL;
}

tp_comm *tp_rendezvous(const tp_config *c, uint8_t uid[TP_UID_BYTES], char *err, size_t errlen) {
    if (!uid || tp_config_check(c, err, errlen)) return NULL;
    if (err && errlen) err[0] = 0;
    return c->rank == 0 ? rendezvous_master(c, uid, err, errlen) : rendezvous_worker(c, uid, err, errlen);
}

int tp_comm_rank(const tp_comm *t) { return t->rank; }
int tp_comm_world(const tp_comm *t) { return t->world; }
const char *tp_comm_error(const tp_comm *t) { return t ? t->err : ""; }

void tp_comm_close(tp_comm *t) {
    if (!t) return;
    for (int i = 0; i < TP_MAX_WORLD; i++)
        if (t->fd[i] >= 0) close(t->fd[i]);
    free(t->ar);
    free(t);
}

int tp_bcast(tp_comm *t, void *buf, size_t n, int timeout_ms) {
    if (!t || (!buf && n)) return SPECD_EINVAL;
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    uint8_t h[16];
    uint32_t seq = t->seq++;
    if (t->rank == 0) {
        put32(h, TP_BC_MAGIC);
        put32(h + 4, seq);
        put32(h + 8, (uint32_t)n);
        put32(h + 12, (uint32_t)((uint64_t)n >> 32));
        for (int k = 1; k < t->world; k++) {
            int rc = send_all(t->fd[k], h, sizeof h, deadline);
            if (!rc) rc = send_all(t->fd[k], buf, n, deadline);
            if (rc)
                return specd_errf(t->err, sizeof t->err, rc, "broadcast %u to rank %d: %s", seq, k,
                                  rc == SPECD_ETIMEOUT ? "timed out" : "rank closed its connection (exited?)");
        }
        return 0;
    }
    int rc = recv_all(t->fd[0], h, sizeof h, deadline);
    if (rc)
        return specd_errf(t->err, sizeof t->err, rc, "rank %d: broadcast %u: %s", t->rank, seq,
                          rc == SPECD_ETIMEOUT ? "timed out" : "rank 0 closed the connection (exited?)");
    uint64_t len = get32(h + 8) | (uint64_t)get32(h + 12) << 32;
    if (get32(h) != TP_BC_MAGIC || get32(h + 4) != seq || len != n)
        return specd_errf(t->err, sizeof t->err, SPECD_EFORMAT,
                          "rank %d: broadcast out of step (seq %u len %llu, expected %u / %zu)", t->rank,
                          get32(h + 4), (unsigned long long)len, seq, n);
    if ((rc = recv_all(t->fd[0], buf, n, deadline)))
        return specd_errf(t->err, sizeof t->err, rc, "rank %d: broadcast %u payload: connection lost",
                          t->rank, seq);
    return 0;
}

static void put_hdr(uint8_t *h, uint32_t magic, uint32_t seq, size_t n) {
    put32(h, magic);
    put32(h + 4, seq);
    put32(h + 8, (uint32_t)n);
    put32(h + 12, (uint32_t)((uint64_t)n >> 32));
}

/* Receive a header and n floats from fd, checking magic, sequence and size. */
static int recv_floats(tp_comm *t, int fd, int peer, uint32_t seq, float *buf, size_t n, int64_t deadline) {
    uint8_t h[16];
    int rc = recv_all(fd, h, sizeof h, deadline);
    if (rc)
        return specd_errf(t->err, sizeof t->err, rc, "rank %d: all-reduce %u with rank %d: %s", t->rank, seq,
                          peer, rc == SPECD_ETIMEOUT ? "timed out" : "connection closed (rank exited?)");
    uint64_t len = get32(h + 8) | (uint64_t)get32(h + 12) << 32;
    if (get32(h) != TP_AR_MAGIC || get32(h + 4) != seq || len != n)
        return specd_errf(t->err, sizeof t->err, SPECD_EFORMAT,
                          "rank %d: all-reduce out of step with rank %d (seq %u len %llu, expected %u / %zu)",
                          t->rank, peer, get32(h + 4), (unsigned long long)len, seq, n);
    if ((rc = recv_all(fd, buf, n * sizeof(float), deadline)))
        return specd_errf(t->err, sizeof t->err, rc, "rank %d: all-reduce %u payload from rank %d: connection lost",
                          t->rank, seq, peer);
    return 0;
}

static int send_floats(tp_comm *t, int fd, int peer, uint32_t seq, const float *buf, size_t n, int64_t deadline) {
    uint8_t h[16];
    put_hdr(h, TP_AR_MAGIC, seq, n);
    int rc = send_all(fd, h, sizeof h, deadline);
    if (!rc) rc = send_all(fd, buf, n * sizeof(float), deadline);
    if (rc)
        return specd_errf(t->err, sizeof t->err, rc, "rank %d: all-reduce %u to rank %d: %s", t->rank, seq, peer,
                          rc == SPECD_ETIMEOUT ? "timed out" : "connection closed (rank exited?)");
    return 0;
}

int tp_allreduce_sum_f32(tp_comm *t, float *buf, size_t n, int timeout_ms) {
    if (!t || (!buf && n)) return SPECD_EINVAL;
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    uint32_t seq = t->seq++;
    int rc;
    if (t->rank != 0) {
        if ((rc = send_floats(t, t->fd[0], 0, seq, buf, n, deadline))) return rc;
        return recv_floats(t, t->fd[0], 0, seq, buf, n, deadline);
    }
    if (n > t->ar_cap) {
        float *p = realloc(t->ar, n * sizeof(float));
        if (!p) return specd_errf(t->err, sizeof t->err, SPECD_ENOMEM, "all-reduce: out of memory");
        t->ar = p;
        t->ar_cap = n;
    }
    /* Fixed order (rank 0's partial, then 1, 2, ...): the sum is the same on every rank. */
    for (int k = 1; k < t->world; k++) {
        if ((rc = recv_floats(t, t->fd[k], k, seq, t->ar, n, deadline))) return rc;
        for (size_t i = 0; i < n; i++) buf[i] += t->ar[i];
    }
    for (int k = 1; k < t->world; k++)
        if ((rc = send_floats(t, t->fd[k], k, seq, buf, n, deadline))) return rc;
    return 0;
}

int tp_step_timeout_ms(void) {
    static int v = 0;   /* benign race: every thread computes the same value */
    if (!v) {
        const char *e = getenv("SPECD_TP_STEP_TIMEOUT_MS");
        long t = e && *e ? strtol(e, NULL, 10) : 60000;
        v = t < 100 ? 100 : t > 86400000 ? 86400000 : (int)t;
    }
    return v;
}

/* ---- watchdog ------------------------------------------------------------------------ */

struct tp_watchdog {
    tp_comm *t;
    tp_children *ch;
    int poll_ms;
    tp_fail_fn fail;
    void *ctx;
    atomic_int stop, failed;
    pthread_t th;
};

/* One pass: a peer socket hung up or errored, or a child exited. why filled on failure. */
static int watch_once(tp_watchdog *w, char *why, size_t n) {
    tp_comm *t = w->t;
    if (t) {
        struct pollfd p[TP_MAX_WORLD];
        int who[TP_MAX_WORLD], np = 0;
        for (int k = 0; k < TP_MAX_WORLD; k++)
            if (t->fd[k] >= 0) {
                p[np] = (struct pollfd){t->fd[k], POLLRDHUP, 0};
                who[np++] = k;
            }
        if (np > 0 && poll(p, (nfds_t)np, 0) > 0)
            for (int i = 0; i < np; i++)
                if (p[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) {
                    snprintf(why, n, "tensor-parallel rank %d: connection to rank %d lost (%s)", t->rank,
                             who[i], p[i].revents & POLLERR ? "error / keepalive timeout" : "closed: rank exited?");
                    return 1;
                }
    }
    int rank;
    char st[64];
    if (w->ch && tp_children_poll(w->ch, &rank, st, sizeof st)) {
        snprintf(why, n, "tensor-parallel rank %d (local worker process) ended: %s", rank, st);
        return 1;
    }
    return 0;
}

static void *watch_main(void *arg) {
    tp_watchdog *w = arg;
    char why[320];
    while (!atomic_load(&w->stop)) {
        if (watch_once(w, why, sizeof why)) {
            atomic_store(&w->failed, 1);
            if (w->fail) w->fail(w->ctx, why);
            break;
        }
        usleep((useconds_t)w->poll_ms * 1000);
    }
    return NULL;
}

tp_watchdog *tp_watchdog_start(tp_comm *t, tp_children *ch, int poll_ms, tp_fail_fn fail,
                               void *ctx, char *err, size_t errlen) {
    tp_watchdog *w = calloc(1, sizeof *w);
    if (!w) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    w->t = t;
    w->ch = ch;
    w->poll_ms = poll_ms > 0 ? poll_ms : 100;
    w->fail = fail;
    w->ctx = ctx;
    if (pthread_create(&w->th, NULL, watch_main, w)) {
        free(w);
        specd_errf(err, errlen, SPECD_EIO, "cannot start the tensor-parallel watchdog thread");
        return NULL;
    }
    return w;
}

int tp_watchdog_failed(const tp_watchdog *w) { return w ? atomic_load(&w->failed) : 0; }

void tp_watchdog_stop(tp_watchdog *w) {
    if (!w) return;
    atomic_store(&w->stop, 1);
    pthread_join(w->th, NULL);
    free(w);
}
