/* cmocka tests for the KV block manager (engine/core/kv.c): null block, LRU order, prefix
 * hits, collision confirmation, eviction, all-or-nothing reserve, fork, the invariant
 * checker itself, sizing, and a seeded random walk that runs kv_check after every op. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/err.h"
#include "engine/core/kv.h"

static kv_pool *make_pool(int num_blocks, int block_size, int cache) {
    char err[256] = "";
    kv_pool_config c = {.num_blocks = num_blocks, .block_size = block_size,
                        .enable_prefix_cache = cache};
    kv_pool *p = kv_pool_create(&c, err, sizeof(err));
    if (!p) fail_msg("kv_pool_create: %s", err);
    return p;
}

/* kv_check over the given tables, failing the test with the checker's message. */
static void check_ok(const kv_pool *p, const kv_seq *const *t, int n) {
    char err[256] = "";
    int rc = kv_check(p, t, n, err, sizeof(err));
    if (rc != 0) fail_msg("kv_check: %s", err);
}

static void seq(kv_seq *s, int cap) { assert_int_equal(kv_seq_init(s, cap), 0); }

static void fill(int32_t *t, int n, int32_t start) {
    for (int i = 0; i < n; i++) t[i] = start + i;
}

static void test_kv_null_block_never_allocated(void **state) {
    (void)state;
    kv_pool *p = make_pool(5, 4, 1);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    for (int round = 0; round < 3; round++) {
        assert_int_equal(kv_seq_reserve(p, &a, 16), 0);
        assert_int_equal(a.n_blocks, 4);
        for (int i = 0; i < 4; i++) assert_int_not_equal(a.blocks[i], 0);
        assert_int_equal(kv_num_free(p), 0);
        assert_int_equal(kv_num_used(p), 4);
        /* The pool is "full" although block 0 is unused: it is not allocatable. */
        assert_int_equal(kv_seq_reserve(p, &b, 1), SPECD_ENOSPACE);
        assert_int_equal(kv_ref(p, 0), 0);
        const kv_seq *t[] = {&a, &b};
        check_ok(p, t, 2);
        kv_seq_release(p, &a);
        assert_int_equal(kv_num_free(p), 4);
    }
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_alloc_fresh_in_order_then_lru_with_tail_first_free(void **state) {
    (void)state;
    kv_pool *p = make_pool(9, 4, 0);
    kv_seq a, b, c;
    seq(&a, 8);
    seq(&b, 8);
    seq(&c, 8);
    assert_int_equal(kv_seq_reserve(p, &a, 12), 0);
    assert_int_equal(kv_seq_reserve(p, &b, 8), 0);
    int32_t want_a[] = {1, 2, 3}, want_b[] = {4, 5};
    assert_memory_equal(a.blocks, want_a, sizeof(want_a));
    assert_memory_equal(b.blocks, want_b, sizeof(want_b));
    /* Free list is now 6,7,8; releasing a appends 3,2,1 (last block first). */
    kv_seq_release(p, &a);
    assert_int_equal(a.n_blocks, 0);
    assert_int_equal(kv_seq_reserve(p, &c, 24), 0);
    int32_t want_c[] = {6, 7, 8, 3, 2, 1};
    assert_memory_equal(c.blocks, want_c, sizeof(want_c));
    const kv_seq *t[] = {&a, &b, &c};
    check_ok(p, t, 3);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_seq_destroy(&c);
    kv_pool_destroy(p);
}

static void test_kv_prefix_hit_shares_blocks_and_bumps_refs(void **state) {
    (void)state;
    kv_pool *p = make_pool(16, 4, 1);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t ta[10], tb[11];
    fill(ta, 10, 100);
    fill(tb, 11, 100);
    tb[9] = 7;   /* differs only inside the third (partial) block */
    assert_int_equal(kv_seq_reserve(p, &a, 10), 0);
    kv_seq_commit(p, &a, ta, 10);
    assert_int_equal(a.n_full_hashed, 2);
    assert_int_equal(kv_num_cached(p), 2);
    int free_before = kv_num_free(p);
    assert_int_equal(kv_seq_match_prefix(p, &b, tb, 11), 8);
    assert_int_equal(b.n_blocks, 2);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(b.blocks[1], a.blocks[1]);
    assert_int_equal(b.n_full_hashed, 2);
    assert_true(b.last_hash == a.last_hash);
    assert_int_equal(kv_ref(p, a.blocks[0]), 2);
    assert_int_equal(kv_ref(p, a.blocks[1]), 2);
    assert_int_equal(kv_ref(p, a.blocks[2]), 1);
    assert_int_equal(kv_num_free(p), free_before);   /* shared, nothing allocated */
    /* Matching again into a non-empty table is a state error. */
    assert_int_equal(kv_seq_match_prefix(p, &b, tb, 11), SPECD_ESTATE);
    const kv_seq *t[] = {&a, &b};
    check_ok(p, t, 2);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_match_never_covers_whole_prompt(void **state) {
    (void)state;
    kv_pool *p = make_pool(16, 4, 1);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t t[12];
    fill(t, 12, 1);
    assert_int_equal(kv_seq_reserve(p, &a, 12), 0);
    kv_seq_commit(p, &a, t, 12);
    assert_int_equal(kv_num_cached(p), 3);
    /* floor((n-1)/bs) blocks at most. */
    int n_in[] = {12, 9, 8, 5, 4, 1};
    int want[] = {8, 8, 4, 4, 0, 0};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kv_seq_match_prefix(p, &b, t, n_in[i]), want[i]);
        assert_int_equal(kv_prefix_lookup(p, t, n_in[i], 8, NULL), want[i]);
        kv_seq_release(p, &b);
    }
    /* The table's capacity also caps the hit. */
    kv_seq small;
    seq(&small, 1);
    assert_int_equal(kv_seq_match_prefix(p, &small, t, 12), 4);
    kv_seq_release(p, &small);
    kv_seq_destroy(&small);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

/* kv_prefix_forget: evictable cached blocks leave the hash table and stay free in place;
 * blocks a live sequence holds keep their hashes. */
static void test_kv_prefix_forget_only_evictable(void **state) {
    (void)state;
    kv_pool *p = make_pool(16, 4, 1);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t ta[9], tb[9];
    fill(ta, 9, 40);
    fill(tb, 9, 90);
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);
    kv_seq_commit(p, &a, ta, 9);
    assert_int_equal(kv_seq_reserve(p, &b, 9), 0);
    kv_seq_commit(p, &b, tb, 9);
    kv_seq_release(p, &a);
    assert_int_equal(kv_num_cached(p), 4);
    const int free_before = kv_num_free(p);
    assert_int_equal(kv_prefix_forget(p), 2);       /* a's two full blocks */
    assert_int_equal(kv_num_cached(p), 2);
    assert_int_equal(kv_num_free(p), free_before);
    assert_int_equal(kv_prefix_lookup(p, ta, 9, 8, NULL), 0);
    assert_int_equal(kv_prefix_lookup(p, tb, 9, 8, NULL), 8);   /* b still holds its blocks */
    const kv_seq *tbl[] = {&b};
    check_ok(p, tbl, 1);
    assert_int_equal(kv_prefix_forget(p), 0);
    kv_seq_release(p, &b);
    assert_int_equal(kv_prefix_forget(p), 2);
    assert_int_equal(kv_num_cached(p), 0);
    assert_int_equal(kv_num_free(p), 15);
    check_ok(p, NULL, 0);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_cached_free_block_revived_by_hit(void **state) {
    (void)state;
    kv_pool *p = make_pool(8, 4, 1);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t t[9];
    fill(t, 9, 40);
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);
    kv_seq_commit(p, &a, t, 9);
    int32_t a0 = a.blocks[0], a1 = a.blocks[1];
    kv_seq_release(p, &a);
    assert_int_equal(kv_num_free(p), 7);
    assert_int_equal(kv_num_cached(p), 2);   /* freed, but still cached */
    int evictable = -1;
    assert_int_equal(kv_prefix_lookup(p, t, 9, 8, &evictable), 8);
    assert_int_equal(evictable, 2);
    assert_int_equal(kv_num_free(p), 7);     /* lookup has no side effects */
    assert_int_equal(kv_seq_match_prefix(p, &b, t, 9), 8);
    assert_int_equal(b.blocks[0], a0);
    assert_int_equal(b.blocks[1], a1);
    assert_int_equal(kv_ref(p, a0), 1);
    assert_int_equal(kv_num_free(p), 5);
    const kv_seq *tb[] = {&a, &b};
    check_ok(p, tb, 2);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static uint64_t const_hash(uint64_t parent, const int32_t *tokens, int n) {
    (void)parent;
    (void)tokens;
    (void)n;
    return 42;
}

static void test_kv_hash_collision_confirmed_by_tokens_and_parent(void **state) {
    (void)state;
    kv_pool *p = make_pool(32, 4, 1);
    assert_int_equal(kv_pool_set_hash_fn(p, const_hash), 0);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t ta[] = {1, 2, 3, 4, 5, 6, 7, 8, 0};
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);
    kv_seq_commit(p, &a, ta, 9);
    assert_int_equal(kv_num_cached(p), 2);   /* both registered under the same hash */
    /* Every block hashes to 42, yet different tokens are never shared. */
    int32_t tb[] = {9, 10, 11, 12, 13, 14, 15, 16, 0};
    assert_int_equal(kv_seq_match_prefix(p, &b, tb, 9), 0);
    /* Same first block, different second: only the first is shared. */
    int32_t tc[] = {1, 2, 3, 4, 9, 9, 9, 9, 0};
    assert_int_equal(kv_seq_match_prefix(p, &b, tc, 9), 4);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    kv_seq_release(p, &b);
    /* Tokens of a's second block at the start of a prompt: same tokens, same hash, but
     * a different parent, so it is not that block. */
    int32_t td[] = {5, 6, 7, 8, 1, 2, 3, 4, 0};
    assert_int_equal(kv_seq_match_prefix(p, &b, td, 9), 0);
    const kv_seq *t[] = {&a, &b};
    check_ok(p, t, 2);
    /* The hash function cannot change under registered entries. */
    assert_int_equal(kv_pool_set_hash_fn(p, NULL), SPECD_ESTATE);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_eviction_of_cached_blocks_when_pool_full(void **state) {
    (void)state;
    kv_pool *p = make_pool(5, 4, 1);
    kv_seq a, b, c;
    seq(&a, 8);
    seq(&b, 8);
    seq(&c, 8);
    int32_t ta[17], tb[8];
    fill(ta, 17, 500);
    fill(tb, 8, 900);
    assert_int_equal(kv_seq_reserve(p, &a, 16), 0);
    kv_seq_commit(p, &a, ta, 16);
    int32_t want_a[] = {1, 2, 3, 4};
    assert_memory_equal(a.blocks, want_a, sizeof(want_a));
    assert_int_equal(kv_num_cached(p), 4);
    kv_seq_release(p, &a);                  /* free list: 4, 3, 2, 1 */
    assert_int_equal(kv_num_free(p), 4);
    assert_int_equal(kv_num_cached(p), 4);
    /* The pool has no fresh blocks: b evicts the LRU cached ones, a's tail blocks. */
    assert_int_equal(kv_seq_reserve(p, &b, 8), 0);
    int32_t want_b[] = {4, 3};
    assert_memory_equal(b.blocks, want_b, sizeof(want_b));
    assert_int_equal(kv_num_cached(p), 2);
    /* a's first two blocks survived and still hit. */
    assert_int_equal(kv_seq_match_prefix(p, &c, ta, 17), 8);
    int32_t want_c[] = {1, 2};
    assert_memory_equal(c.blocks, want_c, sizeof(want_c));
    /* b overwrote blocks 3 and 4; its own commit registers them with b's tokens. */
    kv_seq_commit(p, &b, tb, 8);
    assert_int_equal(kv_num_cached(p), 4);
    const kv_seq *t[] = {&a, &b, &c};
    check_ok(p, t, 3);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_seq_destroy(&c);
    kv_pool_destroy(p);
}

static void test_kv_reserve_all_or_nothing(void **state) {
    (void)state;
    kv_pool *p = make_pool(5, 4, 0);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 3);
    assert_int_equal(kv_seq_reserve(p, &a, 8), 0);
    assert_int_equal(kv_seq_blocks_needed(p, &b, 12), 3);
    assert_int_equal(kv_seq_reserve(p, &b, 12), SPECD_ENOSPACE);
    assert_int_equal(b.n_blocks, 0);
    assert_int_equal(kv_num_free(p), 2);
    assert_int_equal(kv_seq_reserve(p, &b, 13), SPECD_ERANGE);   /* 4 blocks > cap 3 */
    assert_int_equal(b.n_blocks, 0);
    assert_int_equal(kv_seq_reserve(p, &b, 5), 0);
    assert_int_equal(b.n_blocks, 2);
    /* Reserving what the table already holds needs nothing. */
    assert_int_equal(kv_seq_blocks_needed(p, &b, 8), 0);
    assert_int_equal(kv_seq_reserve(p, &b, 3), 0);
    assert_int_equal(b.n_blocks, 2);
    assert_int_equal(kv_num_free(p), 0);
    const kv_seq *t[] = {&a, &b};
    check_ok(p, t, 2);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_fork_shares_full_blocks_and_copies_partial(void **state) {
    (void)state;
    kv_pool *p = make_pool(8, 4, 1);
    kv_seq a, d, e, f;
    seq(&a, 8);
    seq(&d, 8);
    seq(&e, 8);
    seq(&f, 8);
    int32_t t[10];
    fill(t, 10, 3);
    assert_int_equal(kv_seq_reserve(p, &a, 10), 0);
    kv_seq_commit(p, &a, t, 10);
    int32_t cs = -1, cd = -1;
    assert_int_equal(kv_seq_fork(p, &a, &d, &cs, &cd), 1);
    assert_int_equal(d.n_blocks, 3);
    assert_int_equal(d.blocks[0], a.blocks[0]);
    assert_int_equal(d.blocks[1], a.blocks[1]);
    assert_int_equal(cs, a.blocks[2]);
    assert_int_equal(cd, d.blocks[2]);
    assert_int_not_equal(cd, a.blocks[2]);
    assert_int_equal(kv_ref(p, a.blocks[0]), 2);
    assert_int_equal(kv_ref(p, a.blocks[1]), 2);
    assert_int_equal(kv_ref(p, a.blocks[2]), 1);
    assert_int_equal(kv_ref(p, cd), 1);
    assert_int_equal(d.n_full_hashed, 2);
    assert_true(d.last_hash == a.last_hash);
    /* Forking into a non-empty table is refused. */
    assert_int_equal(kv_seq_fork(p, &a, &d, &cs, &cd), SPECD_ESTATE);
    const kv_seq *tt[] = {&a, &d, &e, &f};
    check_ok(p, tt, 4);
    /* A table of only full blocks forks without a copy. */
    kv_seq_release(p, &a);
    assert_int_equal(kv_seq_reserve(p, &a, 8), 0);
    kv_seq_commit(p, &a, t, 8);
    cs = cd = -1;
    assert_int_equal(kv_seq_fork(p, &a, &e, &cs, &cd), 0);
    assert_int_equal(cs, -1);
    assert_int_equal(e.n_blocks, 2);
    check_ok(p, tt, 4);
    /* No block for the copy: ENOSPACE and nothing shared. */
    kv_seq_release(p, &e);
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);   /* a gets a partial third block */
    assert_int_equal(kv_seq_reserve(p, &f, 4 * kv_num_free(p)), 0);
    assert_int_equal(kv_num_free(p), 0);
    int ref0 = kv_ref(p, a.blocks[0]);
    assert_int_equal(kv_seq_fork(p, &a, &e, &cs, &cd), SPECD_ENOSPACE);
    assert_int_equal(e.n_blocks, 0);
    assert_int_equal(kv_ref(p, a.blocks[0]), ref0);
    check_ok(p, tt, 4);
    kv_seq_destroy(&a);
    kv_seq_destroy(&d);
    kv_seq_destroy(&e);
    kv_seq_destroy(&f);
    kv_pool_destroy(p);
}

/* Blocks behind a sliding window: only committed ones drop, they become null entries
 * (kv_check accepts exactly that), go back to the pool with their hash (a later request
 * reuses them), release and fork skip them. */
static void test_kv_drop_front_releases_committed_leading_blocks(void **state) {
    (void)state;
    kv_pool *p = make_pool(12, 4, 1);
    kv_seq a, b, f;
    seq(&a, 10);
    seq(&b, 10);
    seq(&f, 10);
    int32_t t[22];
    fill(t, 22, 7);
    assert_int_equal(kv_seq_reserve(p, &a, 22), 0);     /* 6 blocks */
    kv_seq_commit(p, &a, t, 17);                         /* 4 full blocks hashed */
    int free0 = kv_num_free(p);
    assert_int_equal(kv_seq_drop_front(p, &a, 3), 3);
    assert_int_equal(kv_num_free(p), free0 + 3);
    assert_int_equal(a.n_dropped, 3);
    assert_int_equal(a.blocks[0] | a.blocks[1] | a.blocks[2], 0);
    const kv_seq *ta[] = {&a};
    check_ok(p, ta, 1);
    assert_int_equal(kv_seq_drop_front(p, &a, 9), 1);   /* never past the committed blocks */
    assert_int_equal(a.n_dropped, 4);
    assert_int_equal(kv_seq_drop_front(p, &a, 2), 0);   /* already dropped */
    check_ok(p, ta, 1);
    /* the dropped blocks kept their hashes: the same prompt finds them */
    assert_int_equal(kv_seq_match_prefix(p, &b, t, 22), 16);
    const kv_seq *tab[] = {&a, &b};
    check_ok(p, tab, 2);
    /* fork of a table with dropped entries shares only the live ones */
    int32_t cs, cd;
    kv_seq_commit(p, &a, t, 20);
    assert_true(kv_seq_fork(p, &a, &f, &cs, &cd) >= 0);
    assert_int_equal(f.n_dropped, 4);
    const kv_seq *tabf[] = {&a, &b, &f};
    check_ok(p, tabf, 3);
    /* a corrupted dropped entry is caught */
    a.blocks[0] = b.blocks[0];
    char err[256];
    assert_int_equal(kv_check(p, tabf, 3, err, sizeof err), SPECD_ESTATE);
    a.blocks[0] = 0;
    kv_seq_release(p, &a);
    kv_seq_release(p, &b);
    kv_seq_release(p, &f);
    assert_int_equal(kv_num_used(p), 0);
    check_ok(p, NULL, 0);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_seq_destroy(&f);
    kv_pool_destroy(p);
}

/* A window pool: admission needs only the blocks a new query's window reaches, so a
 * prefix whose first blocks were evicted after a drop still hits; the match puts null
 * entries before the drop point and takes the rest; a miss leaves the table empty. */
static void test_kv_window_lookup_needs_only_the_window(void **state) {
    (void)state;
    enum { W = 6 };
    kv_pool *p = make_pool(13, 4, 1);   /* 12 usable */
    kv_seq a, x, b, c;
    seq(&a, 12);
    seq(&x, 12);
    seq(&b, 12);
    seq(&c, 12);
    int32_t t[44], t2[44];
    fill(t, 44, 100);
    fill(t2, 44, 900);
    assert_int_equal(kv_seq_reserve(p, &a, 40), 0);   /* 10 blocks */
    kv_seq_commit(p, &a, t, 40);
    assert_int_equal(kv_window_drop_upto(40, W, 4), 8);
    assert_int_equal(kv_seq_drop_front(p, &a, kv_window_drop_upto(40, W, 4)), 8);
    /* 2 fresh blocks, then the 8 dropped ones in order: x takes the fresh two and block 0 */
    assert_int_equal(kv_seq_reserve(p, &x, 12), 0);
    assert_int_equal(kv_prefix_lookup(p, t, 41, 12, NULL), 0);   /* the main-pool rule: block 0 is gone */
    int ev = -1;
    assert_int_equal(kv_prefix_lookup_window(p, t, 10, W, &ev), 40);
    assert_int_equal(ev, 0);                                   /* blocks 8 and 9 are a's */
    /* fewer blocks asked: the window of 7 blocks is [5, 7), cached and free */
    assert_int_equal(kv_prefix_lookup_window(p, t, 7, W, &ev), 28);
    assert_int_equal(ev, 2);
    assert_int_equal(kv_seq_match_window(p, &b, t, 40, W), 40);
    assert_int_equal(b.n_dropped, 8);
    assert_int_equal(b.n_blocks, 10);
    assert_int_equal(b.n_full_hashed, 10);
    assert_int_equal(b.blocks[8], a.blocks[8]);
    assert_int_equal(kv_ref(p, a.blocks[9]), 2);
    const kv_seq *tt[] = {&a, &x, &b};
    check_ok(p, tt, 3);
    /* b goes on from there: its commit chains from the matched hash */
    assert_int_equal(kv_seq_reserve(p, &b, 44), 0);
    kv_seq_commit(p, &b, t, 44);
    assert_int_equal(b.n_full_hashed, 11);
    check_ok(p, tt, 3);
    /* nothing of t2 is cached: no hit, and a forced match fails cleanly */
    assert_int_equal(kv_prefix_lookup_window(p, t2, 10, W, &ev), 0);
    assert_int_equal(ev, 0);
    assert_int_equal(kv_seq_match_window(p, &c, t2, 16, W), SPECD_EINVAL);
    assert_int_equal(c.n_blocks, 0);
    const kv_seq *tc[] = {&a, &x, &b, &c};
    check_ok(p, tc, 4);
    kv_seq_release(p, &a);
    kv_seq_release(p, &x);
    kv_seq_release(p, &b);
    assert_int_equal(kv_num_used(p), 0);
    check_ok(p, NULL, 0);
    kv_seq_destroy(&a);
    kv_seq_destroy(&x);
    kv_seq_destroy(&b);
    kv_seq_destroy(&c);
    kv_pool_destroy(p);
}

static void test_kv_check_detects_corruption(void **state) {
    (void)state;
    kv_pool *p = make_pool(6, 4, 1);
    kv_seq a;
    seq(&a, 8);
    assert_int_equal(kv_seq_reserve(p, &a, 8), 0);
    const kv_seq *t[] = {&a};
    char err[256] = "";
    check_ok(p, t, 1);
    /* Corrupted ref count of a held block. */
    assert_int_equal(kv_test_set_ref(p, a.blocks[1], 2), 0);
    assert_int_equal(kv_check(p, t, 1, err, sizeof(err)), SPECD_ESTATE);
    assert_non_null(strstr(err, "has ref 2 but 1 tables"));
    assert_int_equal(kv_test_set_ref(p, a.blocks[1], 1), 0);
    check_ok(p, t, 1);
    /* A free block claiming a holder. */
    assert_int_equal(kv_test_set_ref(p, 5, 1), 0);
    assert_int_equal(kv_check(p, t, 1, err, sizeof(err)), SPECD_ESTATE);
    assert_non_null(strstr(err, "block 5 has ref 1 but 0 tables"));
    assert_int_equal(kv_test_set_ref(p, 5, 0), 0);
    /* A table the caller forgot (refs no longer add up). */
    assert_int_equal(kv_check(p, NULL, 0, err, sizeof(err)), SPECD_ESTATE);
    /* The null block inside a table. */
    int32_t saved = a.blocks[0];
    a.blocks[0] = 0;
    assert_int_equal(kv_check(p, t, 1, err, sizeof(err)), SPECD_ESTATE);
    assert_non_null(strstr(err, "null or out of range"));
    a.blocks[0] = saved;
    /* The null block's ref touched. */
    assert_int_equal(kv_test_set_ref(p, 0, 1), 0);
    assert_int_equal(kv_check(p, t, 1, err, sizeof(err)), SPECD_ESTATE);
    assert_non_null(strstr(err, "null block"));
    assert_int_equal(kv_test_set_ref(p, 0, 0), 0);
    check_ok(p, t, 1);
    kv_seq_destroy(&a);
    kv_pool_destroy(p);
}

static void test_kv_sizing_helpers(void **state) {
    (void)state;
    kv_pool *p = make_pool(10, 16, 1);
    assert_int_equal(kv_num_blocks(p), 10);
    assert_int_equal(kv_block_size(p), 16);
    assert_int_equal(kv_num_free(p), 9);
    assert_int_equal(kv_num_used(p), 0);
    assert_int_equal(kv_blocks_for(p, 0), 0);
    assert_int_equal(kv_blocks_for(p, -3), 0);
    assert_int_equal(kv_blocks_for(p, 1), 1);
    assert_int_equal(kv_blocks_for(p, 16), 1);
    assert_int_equal(kv_blocks_for(p, 17), 2);
    assert_int_equal(kv_blocks_for(p, 4096), 256);
    assert_int_equal(kv_ref(p, 10), SPECD_EINVAL);
    assert_int_equal(kv_ref(p, -1), SPECD_EINVAL);
    kv_seq a;
    assert_int_equal(kv_seq_init(&a, 0), SPECD_EINVAL);
    seq(&a, 4);
    assert_int_equal(kv_seq_blocks_needed(p, &a, 33), 3);
    assert_int_equal(kv_seq_reserve(p, &a, 33), 0);
    assert_int_equal(kv_num_used(p), 3);
    assert_int_equal(kv_num_free(p), 6);
    kv_seq_destroy(&a);
    kv_pool_destroy(p);
    char err[128] = "";
    kv_pool_config bad = {.num_blocks = 1, .block_size = 16};
    assert_null(kv_pool_create(&bad, err, sizeof(err)));
    assert_non_null(strstr(err, "num_blocks must be >= 2 (got 1)"));
    bad = (kv_pool_config){.num_blocks = 8, .block_size = 0};
    assert_null(kv_pool_create(&bad, err, sizeof(err)));
    assert_non_null(strstr(err, "block_size >= 1 (got 0)"));
}

static void test_kv_commit_registers_one_copy_of_identical_blocks(void **state) {
    (void)state;
    kv_pool *p = make_pool(16, 4, 1);
    kv_seq a, b, c;
    seq(&a, 8);
    seq(&b, 8);
    seq(&c, 8);
    int32_t t[9];
    fill(t, 9, 70);
    /* Both compute the same prompt before either commits (no hit for b). */
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);
    assert_int_equal(kv_seq_reserve(p, &b, 9), 0);
    kv_seq_commit(p, &a, t, 9);
    kv_seq_commit(p, &b, t, 9);
    assert_int_equal(kv_num_cached(p), 2);
    assert_int_equal(b.n_full_hashed, 2);
    assert_true(b.last_hash == a.last_hash);
    const kv_seq *tt[] = {&a, &b, &c};
    check_ok(p, tt, 3);
    kv_seq_release(p, &b);
    assert_int_equal(kv_seq_match_prefix(p, &c, t, 9), 8);
    assert_int_equal(c.blocks[0], a.blocks[0]);
    assert_int_equal(c.blocks[1], a.blocks[1]);
    /* Committing again is idempotent. */
    kv_seq_commit(p, &a, t, 9);
    assert_int_equal(kv_num_cached(p), 2);
    check_ok(p, tt, 3);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_seq_destroy(&c);
    kv_pool_destroy(p);
}

static void test_kv_cache_disabled_never_hits(void **state) {
    (void)state;
    kv_pool *p = make_pool(16, 4, 0);
    kv_seq a, b;
    seq(&a, 8);
    seq(&b, 8);
    int32_t t[9];
    fill(t, 9, 1);
    assert_int_equal(kv_seq_reserve(p, &a, 9), 0);
    kv_seq_commit(p, &a, t, 9);
    assert_int_equal(a.n_full_hashed, 2);   /* still tracked: fork needs it */
    assert_int_equal(kv_num_cached(p), 0);
    assert_int_equal(kv_seq_match_prefix(p, &b, t, 9), 0);
    assert_int_equal(kv_prefix_lookup(p, t, 9, 8, NULL), 0);
    const kv_seq *tt[] = {&a, &b};
    check_ok(p, tt, 2);
    kv_seq_destroy(&a);
    kv_seq_destroy(&b);
    kv_pool_destroy(p);
}

static void test_kv_hash_depends_on_parent_tokens_order_and_length(void **state) {
    (void)state;
    int32_t x[] = {1, 2, 3, 4}, y[] = {2, 1, 3, 4}, z[] = {1, 2, 3, 5};
    uint64_t h = kv_hash_block(7, x, 4);
    assert_true(h == kv_hash_block(7, x, 4));
    assert_true(h != kv_hash_block(8, x, 4));
    assert_true(h != kv_hash_block(7, y, 4));
    assert_true(h != kv_hash_block(7, z, 4));
    assert_true(h != kv_hash_block(7, x, 3));
    int32_t zero[2] = {0, 0};
    assert_true(kv_hash_block(0, zero, 1) != kv_hash_block(0, zero, 2));
}

/* ---- random walk -------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int rng_int(uint64_t *s, int n) { return (int)(rng_next(s) % (uint64_t)n); }

enum { RW_TABLES = 10, RW_CAP = 12, RW_BS = 4, RW_MAXTOK = RW_CAP * RW_BS };

typedef struct {
    kv_seq kv;
    int32_t tok[RW_MAXTOK];
    int n_tok;       /* tokens written (their KV "computed") */
} rw_seq;

/* Tokens from a tiny vocabulary and shared stems so prefix hits are frequent. */
static void rw_fill_prompt(uint64_t *r, rw_seq *q, int n) {
    int stem = rng_int(r, 3);
    for (int i = 0; i < n; i++)
        q->tok[i] = i < 8 ? stem * 10 + (i % 4) : rng_int(r, 3);
}

static void test_kv_random_walk_keeps_invariants(void **state) {
    (void)state;
    kv_pool *p = make_pool(24, RW_BS, 1);
    static rw_seq q[RW_TABLES];
    const kv_seq *tables[RW_TABLES];
    for (int i = 0; i < RW_TABLES; i++) {
        seq(&q[i].kv, RW_CAP);
        q[i].n_tok = 0;
        tables[i] = &q[i].kv;
    }
    uint64_t r = 0x1234567887654321ULL;
    int hits = 0, forks = 0, nospace = 0;
    for (int op = 0; op < 20000; op++) {
        rw_seq *a = &q[rng_int(&r, RW_TABLES)];
        switch (rng_int(&r, 5)) {
        case 0: /* start: prefix match then reserve the rest of a new prompt */
            if (a->kv.n_blocks == 0) {
                int n = 1 + rng_int(&r, 20);
                rw_fill_prompt(&r, a, n);
                int hit = kv_seq_match_prefix(p, &a->kv, a->tok, n);
                assert_true(hit >= 0 && hit % RW_BS == 0 && hit < n);
                hits += hit > 0;
                if (kv_seq_reserve(p, &a->kv, n) == 0) {
                    a->n_tok = n;
                    kv_seq_commit(p, &a->kv, a->tok, n);
                } else {
                    nospace++;
                    kv_seq_release(p, &a->kv);
                    a->n_tok = 0;
                }
            }
            break;
        case 1: /* append: decode a few tokens */
            if (a->kv.n_blocks > 0 && a->n_tok < RW_MAXTOK) {
                int add = 1 + rng_int(&r, 4);
                if (a->n_tok + add > RW_MAXTOK) add = RW_MAXTOK - a->n_tok;
                int free0 = kv_num_free(p), nb0 = a->kv.n_blocks;
                if (kv_seq_reserve(p, &a->kv, a->n_tok + add) == 0) {
                    for (int i = 0; i < add; i++) a->tok[a->n_tok + i] = rng_int(&r, 3);
                    a->n_tok += add;
                    kv_seq_commit(p, &a->kv, a->tok, a->n_tok);
                } else {
                    nospace++;
                    assert_int_equal(kv_num_free(p), free0);   /* all or nothing */
                    assert_int_equal(a->kv.n_blocks, nb0);
                }
            }
            break;
        case 2: /* fork into an empty table */
        {
            rw_seq *b = &q[rng_int(&r, RW_TABLES)];
            if (a != b && a->kv.n_blocks > 0 && b->kv.n_blocks == 0) {
                int32_t cs, cd;
                int rc = kv_seq_fork(p, &a->kv, &b->kv, &cs, &cd);
                assert_true(rc == 0 || rc == 1 || rc == SPECD_ENOSPACE);
                if (rc >= 0) {
                    forks++;
                    memcpy(b->tok, a->tok, sizeof(a->tok));
                    /* a's table is exactly ceil(n_tok / bs) blocks, all but a partial
                     * last one committed: the fork holds all of a's tokens. */
                    assert_int_equal(rc, a->n_tok % RW_BS != 0);
                    b->n_tok = a->n_tok;
                }
            }
            break;
        }
        case 3:
        case 4: /* free */
            if (rng_int(&r, 3) == 0) {
                kv_seq_release(p, &a->kv);
                a->n_tok = 0;
            }
            break;
        }
        char err[256] = "";
        if (kv_check(p, tables, RW_TABLES, err, sizeof(err)) != 0)
            fail_msg("op %d: %s", op, err);
    }
    /* The walk must have exercised the interesting paths. */
    assert_true(hits > 100);
    assert_true(forks > 100);
    assert_true(nospace > 10);
    for (int i = 0; i < RW_TABLES; i++) kv_seq_release(p, &q[i].kv);
    check_ok(p, tables, RW_TABLES);
    assert_int_equal(kv_num_free(p), 23);
    assert_int_equal(kv_num_used(p), 0);
    for (int i = 0; i < RW_TABLES; i++) kv_seq_destroy(&q[i].kv);
    kv_pool_destroy(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_null_block_never_allocated),
        cmocka_unit_test(test_kv_alloc_fresh_in_order_then_lru_with_tail_first_free),
        cmocka_unit_test(test_kv_prefix_hit_shares_blocks_and_bumps_refs),
        cmocka_unit_test(test_kv_match_never_covers_whole_prompt),
        cmocka_unit_test(test_kv_cached_free_block_revived_by_hit),
        cmocka_unit_test(test_kv_hash_collision_confirmed_by_tokens_and_parent),
        cmocka_unit_test(test_kv_eviction_of_cached_blocks_when_pool_full),
        cmocka_unit_test(test_kv_reserve_all_or_nothing),
        cmocka_unit_test(test_kv_fork_shares_full_blocks_and_copies_partial),
        cmocka_unit_test(test_kv_check_detects_corruption),
        cmocka_unit_test(test_kv_sizing_helpers),
        cmocka_unit_test(test_kv_commit_registers_one_copy_of_identical_blocks),
        cmocka_unit_test(test_kv_cache_disabled_never_hits),
        cmocka_unit_test(test_kv_hash_depends_on_parent_tokens_order_and_length),
        cmocka_unit_test(test_kv_random_walk_keeps_invariants),
        cmocka_unit_test(test_kv_drop_front_releases_committed_leading_blocks),
        cmocka_unit_test(test_kv_window_lookup_needs_only_the_window),
        cmocka_unit_test(test_kv_prefix_forget_only_evictable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
