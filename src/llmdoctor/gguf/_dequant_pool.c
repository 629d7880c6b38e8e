/* A small thread pool that shares the chunks of one native dequantization call (part of the
 * _dequant_native extension).
 *
 * llmd_dq_parallel(fn, ...) cuts n_blocks into chunks of chunk_blocks and runs fn on every chunk, on
 * the calling thread and up to n_threads - 1 helper threads; it returns when all chunks are done.
 * Chunks are claimed one at a time (a thread that is descheduled delays only the chunk it holds).
 * Helpers spin for 50 us after each job before they sleep, so that the next tensor's call, usually
 * microseconds later, finds them awake: a Python thread pool's hand-off cost ~40 us per tensor here,
 * which is a quarter of the time of a typical 1M-value tensor.
 *
 * Protocol. A job is published with a generation number g. `ticket` packs (g, next chunk index);
 * a chunk is claimed by a compare-and-swap that succeeds only while the ticket still carries the
 * claimer's generation, so a helper that wakes late can never take a chunk of a later job. The caller
 * starts job g + 1 only after every chunk of job g is done, and it invalidates old tickets (ticket =
 * (g + 1, 0)) before it rewrites the job's fields; fields are stored with release and loaded with
 * acquire, so whoever reads a field of job g + 1 also sees the new ticket and fails its claim.
 * The generation has 32 bits: a helper stalled between reading a job and claiming from it across
 * 2^32 later jobs could claim a chunk of the wrong one (found in review with a 2-bit generation).
 * After fork() the child has no helpers; they are recreated on its first call.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

typedef void (*llmd_driver)(const uint8_t *, float *, int64_t, const int8_t *, int);

#define MAX_HELPERS 63
#define GEN_SHIFT 32 /* ticket: generation in the high 32 bits, chunk index in the low 32 */
#define IDX_MASK ((UINT64_C(1) << GEN_SHIFT) - 1)
#define SPIN_BEFORE_SLEEP_NS 50000 /* a helper spins this long for the next job, then sleeps */
#define SPIN_BEFORE_YIELD 2000

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int sleepers; /* under mu */
    int started;  /* helpers running (touched by callers only) */
    _Atomic uint64_t gen;
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    /* the job */
    _Atomic uintptr_t fn, src, dst, kv;
    _Atomic int64_t n_blocks, type_size, block_size, chunk_blocks, n_chunks;
    _Atomic int stream, helpers_wanted;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static uint64_t helper_start_gen[MAX_HELPERS]; /* the generation before the job a new helper first joins */

#define LOAD(x) atomic_load_explicit(&P.x, memory_order_acquire)
#define STORE(x, v) atomic_store_explicit(&P.x, (v), memory_order_release)

/* Claim and run chunks of job g until none is left. */
static void run_chunks(uint64_t g) {
    const llmd_driver fn = (llmd_driver)LOAD(fn);
    const uint8_t *src = (const uint8_t *)LOAD(src);
    float *dst = (float *)LOAD(dst);
    const int8_t *kv = (const int8_t *)LOAD(kv);
    const int64_t n_blocks = LOAD(n_blocks), ts = LOAD(type_size), bs = LOAD(block_size);
    const int64_t chunk = LOAD(chunk_blocks), n_chunks = LOAD(n_chunks);
    const int stream = LOAD(stream);
    const uint64_t tag = (g << GEN_SHIFT) & ~IDX_MASK;
    uint64_t t = atomic_load(&P.ticket);
    for (;;) {
        if ((t & ~IDX_MASK) != tag || (int64_t)(t & IDX_MASK) >= n_chunks) return;
        if (!atomic_compare_exchange_weak(&P.ticket, &t, t + 1)) continue; /* t reloaded */
        const int64_t b0 = (int64_t)(t & IDX_MASK) * chunk;
        const int64_t nb = n_blocks - b0 < chunk ? n_blocks - b0 : chunk;
        fn(src + b0 * ts, dst + b0 * bs, nb, kv, stream);
        atomic_fetch_add(&P.done, 1);
        t = atomic_load(&P.ticket);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = helper_start_gen[index]; /* not LOAD(gen): the job it was created for may be out */
    for (;;) {
        uint64_t g = LOAD(gen);
        const int64_t until = now_ns() + SPIN_BEFORE_SLEEP_NS;
        for (int i = 1; g == seen; i++) {
            CPU_RELAX();
            g = LOAD(gen);
            if (i % 64 == 0 && now_ns() > until) break; /* (pause takes 10-140 cycles by CPU) */
        }
        if (g == seen) {
            pthread_mutex_lock(&P.mu);
            P.sleepers++;
            while ((g = LOAD(gen)) == seen) pthread_cond_wait(&P.cv, &P.mu);
            P.sleepers--;
            pthread_mutex_unlock(&P.mu);
        }
        seen = g;
        if (index < LOAD(helpers_wanted)) run_chunks(g);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    P.sleepers = 0;
    P.started = 0;
}

static void install_atfork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* Not reentrant: one caller at a time (dequant.py holds a lock around it). */
void llmd_dq_parallel(llmd_driver fn, const uint8_t *src, float *dst, int64_t n_blocks, int64_t type_size,
                      int64_t block_size, const int8_t *kv, int stream, int64_t chunk_blocks, int n_threads) {
    if (n_blocks <= 0) return;
    if (chunk_blocks < 1 || chunk_blocks > n_blocks) chunk_blocks = chunk_blocks < 1 ? 1 : n_blocks;
    const int64_t n_chunks = (n_blocks - 1) / chunk_blocks + 1;
    int helpers = n_threads < 1 ? 0 : n_threads - 1;
    if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
    if (helpers > n_chunks - 1) helpers = (int)(n_chunks - 1);
    if (helpers <= 0 || n_chunks > (int64_t)IDX_MASK) { /* (a chunk index must fit its 32 bits) */
        fn(src, dst, n_blocks, kv, stream);
        return;
    }
    pthread_once(&atfork_once, install_atfork);
    while (P.started < helpers) {
        pthread_t th;
        helper_start_gen[P.started] = LOAD(gen);
        if (pthread_create(&th, NULL, helper, (void *)(intptr_t)P.started) != 0) break;
        pthread_detach(th);
        P.started++;
    }
    const uint64_t g = LOAD(gen) + 1;
    atomic_store(&P.done, 0);
    atomic_store(&P.ticket, (g << GEN_SHIFT) & ~IDX_MASK); /* old claims fail from here on */
    STORE(fn, (uintptr_t)fn);
    STORE(src, (uintptr_t)src);
    STORE(dst, (uintptr_t)dst);
    STORE(kv, (uintptr_t)kv);
    STORE(n_blocks, n_blocks);
    STORE(type_size, type_size);
    STORE(block_size, block_size);
    STORE(chunk_blocks, chunk_blocks);
    STORE(n_chunks, n_chunks);
    STORE(stream, stream);
    STORE(helpers_wanted, helpers < P.started ? helpers : P.started);
    STORE(gen, g);
    pthread_mutex_lock(&P.mu);
    if (P.sleepers) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    run_chunks(g);
    for (int i = 0; atomic_load(&P.done) < n_chunks; i++) {
        if (i < SPIN_BEFORE_YIELD) CPU_RELAX();
        else sched_yield(); /* a helper holding the last chunk was descheduled: let it run */
    }
}
