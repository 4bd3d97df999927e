/* Tensor-parallel process group (prefix tp_, beside the thread pool's tp_pool/tp_run):
 * the launcher of this host's worker ranks, the TCP rendezvous that hands every rank the
 * NCCL unique id, a byte broadcast from rank 0 over the rendezvous sockets (the fallback
 * for tests and machines without NCCL; on GPUs the step broadcast goes over NCCL,
 * cuda_tp.h), and a watchdog that notices a dead rank. Pure C + POSIX; no CUDA.
 *
 * Processes: one per GPU, as torchrun does. On one host `specd serve
 * --tensor-parallel-size N` is rank 0; it calls tp_spawn_local() which fork/execs itself
 * N-1 times with SPECD_TP_RANK / SPECD_TP_LOCAL_RANK / SPECD_TP_WORLD / SPECD_TP_NNODES /
 * SPECD_TP_MASTER=host:port and NCCL_NVLS_ENABLE=0 in the environment; a process that
 * finds SPECD_TP_RANK set (tp_config_from_env) is a worker: it runs no HTTP and follows
 * rank 0's step broadcasts. Across hosts every node runs the same command with --nnodes,
 * --node-rank, --master-addr, --master-port; node k's process is global rank
 * k * (N / nnodes) and spawns the node's other ranks. The children die with their parent
 * (PR_SET_PDEATHSIG), so a killed rank 0 never leaves GPU workers behind.
 *
 * Rendezvous: rank 0 listens on master-addr:master-port; each other rank connects
 * (retrying until the timeout: rank 0 may start later) and sends a hello (magic "SPTP",
 * protocol version, world size, nnodes, its rank). Rank 0 checks every field, waits for
 * all N-1 ranks, then answers each with status 0 and the 128-byte unique id (opaque here).
 * Any mismatch fails the whole rendezvous on every rank with a message naming the rank,
 * its address and the field. The sockets stay open: they carry tp_bcast and tell the
 * watchdog when a peer dies (TCP keepalive bounds the time to notice a dead host).
 *
 * Failure: tp_watchdog polls the peer sockets (hang-up / error) and waitpid()s this host's
 * children every poll_ms. On the first failure it calls the caller's fail callback once
 * (from the watchdog thread) with a one-line reason. The callback belongs to main: mark the
 * engine unhealthy, abort NCCL (cuda_tp_abort), and _exit non-zero after a short grace; the
 * library itself never exits. A hung rank that keeps its socket open is caught by the NCCL
 * side instead (cuda_tp_wait's timeout on the step's collectives).
 *
 * Threading: a tp_comm is used by one thread (the engine thread) for tp_bcast; the
 * watchdog thread only polls its sockets for hang-ups, never reads or writes them. */
#ifndef SPECD_TP_H
#define SPECD_TP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define TP_UID_BYTES 128     /* sizeof(ncclUniqueId) */
#define TP_MAX_WORLD 256
#define TP_DEFAULT_PORT 29533

typedef struct {
    int world_size;          /* --tensor-parallel-size: ranks over all nodes */
    int nnodes;              /* --nnodes (default 1); world_size % nnodes == 0 */
    int node_rank;           /* --node-rank (default 0) */
    char master_addr[256];   /* --master-addr (default 127.0.0.1) */
    int master_port;         /* --master-port (default TP_DEFAULT_PORT) */
    int rank;                /* this process's global rank */
    int local_rank;          /* its GPU ordinal on this host */
    int timeout_ms;          /* rendezvous timeout (default 300000: model loading is slow) */
} tp_config;

/* Defaults for every field; rank = local_rank = node_rank * (world / nnodes). */
void tp_config_defaults(tp_config *c);
/* Check the launcher fields (world, nnodes, node_rank, port, rank range). */
int tp_config_check(const tp_config *c, char *err, size_t errlen);
/* Ranks per node. */
static inline int tp_nproc_per_node(const tp_config *c) { return c->world_size / c->nnodes; }

/* Worker side: when SPECD_TP_RANK is in the environment, fill rank, local_rank,
 * world_size, nnodes, master_addr/port from SPECD_TP_* and return 1; return 0 when it is
 * absent (this process is not a spawned worker); a malformed value is SPECD_EINVAL. */
int tp_config_from_env(tp_config *c, char *err, size_t errlen);

/* Set NCCL_NVLS_ENABLE=0 in this process's environment (NVLink SHARP multicast stays
 * off; must precede ncclCommInitRank). Children of tp_spawn_local get it too. */
int tp_set_nccl_env(void);

/* ---- local launcher ------------------------------------------------------------------ */

typedef struct tp_children tp_children;

/* fork/exec this node's other ranks (local ranks 1 .. nproc-1). exe: the program (NULL:
 * this executable, /proc/self/exe); argv: its argv (NULL-terminated), typically main's
 * own, so workers parse the same options. The environment is ours plus the SPECD_TP_*
 * variables and NCCL_NVLS_ENABLE=0. */
tp_children *tp_spawn_local(const tp_config *c, const char *exe, char *const argv[], char *err,
                            size_t errlen);
int tp_children_count(const tp_children *ch);
pid_t tp_children_pid(const tp_children *ch, int i);       /* i: 0 .. count-1 */
/* Non-blocking: 0 while all run; 1 when one has exited (reaped), with its global rank
 * and a description ("exit 3", "signal 9") in why. */
int tp_children_poll(tp_children *ch, int *rank, char *why, size_t whylen);
/* SIGTERM the ones still running, SIGKILL after grace_ms, reap all. Returns 0 when every
 * child exited 0 (before this call or after SIGTERM), else 1. */
int tp_children_stop(tp_children *ch, int grace_ms);
/* Wait up to timeout_ms for every child to exit on its own (after a STOP): 0 when all
 * exited 0, 1 when one did not, SPECD_ETIMEOUT when some still run (tp_children_stop). */
int tp_children_wait(tp_children *ch, int timeout_ms);
void tp_children_free(tp_children *ch);  /* stops them first if still running */

/* ---- rendezvous and broadcast -------------------------------------------------------- */

typedef struct tp_comm tp_comm;

/* Rank 0: uid is input (ncclGetUniqueId's bytes) and is sent to all; other ranks: uid is
 * output. Blocks until every rank has joined or timeout_ms passed (SPECD_ETIMEOUT,
 * naming the missing ranks). */
tp_comm *tp_rendezvous(const tp_config *c, uint8_t uid[TP_UID_BYTES], char *err, size_t errlen);
int tp_comm_rank(const tp_comm *t);
int tp_comm_world(const tp_comm *t);
/* Broadcast n bytes from rank 0 to every rank (rank 0 sends buf, the others receive into
 * it), like ncclBroadcast. timeout_ms < 0: wait forever (a worker waiting for the next
 * step). Each message carries a sequence number, checked on receipt. A closed peer is
 * SPECD_EIO with a message in the comm (tp_comm_error). */
int tp_bcast(tp_comm *t, void *buf, size_t n, int timeout_ms);
/* In-place sum of n floats over all ranks (the CPU all-reduce): every rank sends its
 * buffer to rank 0, which adds the partials in rank order and sends the sum back, so all
 * ranks end with the same bits. Correctness over speed: 2 (W-1) n floats cross rank 0's
 * sockets. Shares tp_bcast's sequence numbers; errors as tp_bcast. */
int tp_allreduce_sum_f32(tp_comm *t, float *buf, size_t n, int timeout_ms);
const char *tp_comm_error(const tp_comm *t);
void tp_comm_close(tp_comm *t);

/* ---- watchdog ------------------------------------------------------------------------ */

typedef struct tp_watchdog tp_watchdog;
typedef void (*tp_fail_fn)(void *ctx, const char *why);

/* Watch t's peer sockets (may be NULL) and ch's processes (may be NULL) every poll_ms
 * (default 100 when <= 0); call fail(ctx, why) once on the first death. */
tp_watchdog *tp_watchdog_start(tp_comm *t, tp_children *ch, int poll_ms, tp_fail_fn fail,
                               void *ctx, char *err, size_t errlen);
int tp_watchdog_failed(const tp_watchdog *w);   /* 1 after a failure was seen */
void tp_watchdog_stop(tp_watchdog *w);          /* joins the thread */

/* Longest wait on another rank inside a step (engine/tp/runner_tp.h's
 * RUNNER_TP_STEP_TIMEOUT_MS): SPECD_TP_STEP_TIMEOUT_MS, else 60000; read once, >= 100. */
int tp_step_timeout_ms(void);

#endif
