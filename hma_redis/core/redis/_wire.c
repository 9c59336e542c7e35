/*
 * hma_redis.core.redis._wire: the per-byte work of a transfer job, with the GIL released.
 *
 * Narrow surface (the Python side is hma_redis/core/redis/wire.py, which also holds a pure-Python
 * implementation of the same functions: the test oracle and the fallback):
 *
 *   crc32c(data, value=0) -> int
 *       CRC32C (Castagnoli) of a buffer, continuing from ``value``; the same result as the
 *       ``crc32c`` package. SSE4.2 instructions where the CPU has them (checked at run time),
 *       a portable table otherwise.
 *   crc32c_parts(buffers, value=0) -> int
 *       crc32c of the buffers back to back, in one call (a store's header and pages).
 *   load_values(fd, commands, targets, timeout_s, window=0, budget_s=0, one_thread=False,
 *               piece_bytes=0)
 *       Send one command per target (a GET; with ``piece_bytes`` P, a target whose max_len
 *       exceeds P is asked for with STRLEN and GETRANGEs of P bytes: see value_t), read its
 *       replies, receive each value straight into the target's memory, CRC32C over
 *       header || body as it arrives.
 *       ``one_thread``: read every connection on the calling thread, in turn (an A/B switch
 *       for benchmarks; the same bytes and results).
 *   store_values(fd, values, timeout_s, budget_s=0) -> list[tuple]
 *       For each (framing, head, pages, tail) value: CRC32C of header || pages into the
 *       head's CRC field, then send the pieces in place with sendmsg; then read one reply per
 *       value.
 *   ``fd`` is one socket, or a sequence of 1 to 64 (the job's connections): value i then
 *   travels on connection i mod k. A load reads each connection on a thread of its own (the
 *   calling thread and one started per further connection for the call, all joined before it
 *   returns), so one receives while Redis prepares another's reply; a store sends and reads
 *   its connections in turn on the calling thread, Redis reading one connection's value while
 *   this thread sends another's. On two cores a worker's 512 KiB loads ran 1.25x faster with a
 *   thread per connection than with one thread reading both in turn, where stores gained
 *   nothing (docs/performance.md).
 *   hardware_crc() -> bool
 *       Whether crc32c runs on CRC instructions.
 *   crc_engine() -> str
 *       Which: "VPCLMULQDQ folding" (AVX-512 carry-less multiplies for runs of 1 KiB and more,
 *       the CRC instruction for the rest), "SSE4.2", or "" (the table). The environment
 *       variable HMA_REDIS_CRC_NO_FOLD, set when the module loads, turns the folding off (an
 *       A/B switch for benchmarks; the bytes are the same either way).
 *
 * Threading: Python objects are touched only while the GIL is held (argument parsing, buffer
 * export, result building). Every loop over bytes, every syscall and every wait runs between
 * Py_BEGIN_ALLOW_THREADS and Py_END_ALLOW_THREADS, working on plain C structs; a load's extra
 * threads never touch Python objects, each owns one connection and its targets, and all of
 * them are joined before the GIL is taken back.
 *
 * Sockets: every recv/send uses MSG_DONTWAIT and waits with poll() for at most timeout_s when
 * the socket has nothing (as a Python socket timeout bounds each wait), so blocking and
 * non-blocking fds behave alike. With budget_s > 0 the whole call has a deadline too: each
 * poll() waits at most until it, and a call that reaches it fails as a timeout (a server
 * sending a byte just before every timeout cannot stretch a job). A timeout, an EOF or a
 * malformed reply raises (TimeoutError,
 * ConnectionError, ProtocolError): the streams are then at unknown positions and the caller
 * must drop every connection of the call.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define HAVE_X86_CRC 1
#endif
#if defined(__x86_64__) && (defined(__GNUC__) && __GNUC__ >= 8 || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86_FOLD 1
#endif

/* ------------------------------------------------------------------------------------------
 * CRC32C
 *
 * Registers are "raw" (no pre/post inversion) inside this section; the public value is
 * ~raw(~value), as in every CRC32C library.
 * ---------------------------------------------------------------------------------------- */

#define CRC_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

/* The hardware loop runs three independent lanes of ``stride`` bytes, then moves the first two
 * lanes' registers past the bytes after them ("shift": multiply by x^(8*bytes) mod P, a linear
 * map on 32 bits, done with four table lookups). Several strides, so the pieces a receive
 * checksums (16 KiB pages, say) get the three lanes too. */
#define CRC_TIERS 3
static const size_t crc_strides[CRC_TIERS] = {8192, 2048, 512};
static uint32_t crc_shift[CRC_TIERS][2][4][256]; /* [tier][past 1 or 2 strides][byte][value] */

static uint32_t crc_table[8][256];
static int crc_hw;   /* the CPU has SSE4.2 */
static int crc_fold; /* ... and AVX-512 with VPCLMULQDQ (4 carry-less multiplies at once) */

/* a * b mod P in the reflected representation (x^0 is the top bit). */
static uint32_t gf2_mult(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) product ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return product;
}

/* x^n mod P, by square and multiply. */
static uint32_t gf2_xpow(uint64_t n) {
    uint32_t result = 1u << 31; /* x^0 */
    uint32_t base = 1u << 30;   /* x^1 */
    while (n) {
        if (n & 1) result = gf2_mult(result, base);
        base = gf2_mult(base, base);
        n >>= 1;
    }
    return result;
}

/* A register moved past the bytes a shift table was built for. */
static inline uint32_t crc_apply_shift(const uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
           table[3][crc >> 24];
}

#if defined(__x86_64__) && (defined(__GNUC__) && __GNUC__ >= 8 || defined(__clang__))
static void fold_init(void);
#endif

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC_POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xff];
    for (int tier = 0; tier < CRC_TIERS; tier++) {
        for (int lanes = 0; lanes < 2; lanes++) {
            uint32_t k = gf2_xpow(8ull * crc_strides[tier] * (uint64_t)(lanes + 1));
            for (int j = 0; j < 4; j++)
                for (uint32_t b = 0; b < 256; b++)
                    crc_shift[tier][lanes][j][b] = gf2_mult(k, b << (8 * j));
        }
    }
#ifdef HAVE_X86_CRC
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
#ifdef HAVE_X86_FOLD
    crc_fold = crc_hw && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
               getenv("HMA_REDIS_CRC_NO_FOLD") == NULL;
    if (crc_fold) fold_init();
#endif
}

/* Portable slicing-by-8. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        word ^= crc; /* little-endian: the register meets the first four bytes */
        crc = crc_table[7][word & 0xff] ^ crc_table[6][(word >> 8) & 0xff] ^
              crc_table[5][(word >> 16) & 0xff] ^ crc_table[4][(word >> 24) & 0xff] ^
              crc_table[3][(word >> 32) & 0xff] ^ crc_table[2][(word >> 40) & 0xff] ^
              crc_table[1][(word >> 48) & 0xff] ^ crc_table[0][word >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    return crc;
}

#ifdef HAVE_X86_CRC
/* SSE4.2: three independent lanes hide the instruction's latency; lanes are joined by
 * shifting the earlier ones past the later ones' bytes (CRC is linear over GF(2)). */
__attribute__((target("sse4.2"))) static uint32_t crc_x86(uint32_t crc, const uint8_t *p,
                                                          size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        n--;
    }
    for (int tier = 0; tier < CRC_TIERS; tier++) {
        const size_t stride = crc_strides[tier];
        while (n >= 3 * stride) {
            uint64_t c0 = crc, c1 = 0, c2 = 0;
            for (size_t i = 0; i < stride; i += 8) {
                uint64_t w0, w1, w2;
                memcpy(&w0, p + i, 8);
                memcpy(&w1, p + stride + i, 8);
                memcpy(&w2, p + 2 * stride + i, 8);
                c0 = _mm_crc32_u64(c0, w0);
                c1 = _mm_crc32_u64(c1, w1);
                c2 = _mm_crc32_u64(c2, w2);
            }
            crc = crc_apply_shift(crc_shift[tier][1], (uint32_t)c0) ^
                  crc_apply_shift(crc_shift[tier][0], (uint32_t)c1) ^ (uint32_t)c2;
            p += 3 * stride;
            n -= 3 * stride;
        }
    }
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) crc = _mm_crc32_u8(crc, *p++);
    return crc;
}
#endif

#ifdef HAVE_X86_FOLD
/* Folding with carry-less multiplies (VPCLMULQDQ on 512-bit registers): sixteen 128-bit lanes
 * take 256 bytes a round. A lane A (its first 8 bytes are A's high coefficients, bit-reflected
 * like everything here) is moved D bits forward, to the lane D bits later, as
 * A_hi * (x^(64+D) mod P) + A_lo * (x^D mod P): congruent mod P and under 96 bits, XORed into
 * the later lane's bytes. At the end every lane is folded onto the last one, whose 16 bytes then
 * have the CRC of the whole run, taken with the CRC instruction. A reflected 64x64 product
 * lands one bit low in the 128-bit result, so each constant is x^(n-1) mod P: the same as
 * the product of x^n. The initial register is XORed into the first 4 bytes (what a CRC
 * register means). The tail, under 256 bytes, goes on the 3-lane loop. */
#define FOLD_ROUND 256
#define FOLD_MIN 1024 /* below it the 3-lane loop is as fast */

static uint64_t fold_round_k[2];   /* D = 256 bytes: the main loop */
static uint64_t fold_lane_k[16][2]; /* lane i of the last round onto lane 15; lane 15: 0 */

/* rev64(x^n mod P): the reflected 32-bit register (x^0 at bit 31) in the top half. */
static uint64_t fold_const(uint64_t n) {
    return (uint64_t)gf2_xpow(n) << 32;
}

static void fold_init(void) {
    fold_round_k[0] = fold_const(64 + 8 * FOLD_ROUND - 1);
    fold_round_k[1] = fold_const(8 * FOLD_ROUND - 1);
    for (int lane = 0; lane < 15; lane++) {
        uint64_t d = 128ull * (uint64_t)(15 - lane);
        fold_lane_k[lane][0] = fold_const(64 + d - 1);
        fold_lane_k[lane][1] = fold_const(d - 1);
    }
    fold_lane_k[15][0] = fold_lane_k[15][1] = 0;
}

#define FOLD_TARGET "avx512f,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(FOLD_TARGET))) static inline __m512i fold_lanes(__m512i x, __m512i k) {
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                            _mm512_clmulepi64_epi128(x, k, 0x11));
}

__attribute__((target(FOLD_TARGET))) static __m512i fold_lane_keys(int first) {
    const uint64_t(*k)[2] = fold_lane_k + first;
    return _mm512_set_epi64((long long)k[3][1], (long long)k[3][0], (long long)k[2][1],
                            (long long)k[2][0], (long long)k[1][1], (long long)k[1][0],
                            (long long)k[0][1], (long long)k[0][0]);
}

/* n >= FOLD_ROUND. */
__attribute__((target(FOLD_TARGET))) static uint32_t crc_folded(uint32_t crc, const uint8_t *p,
                                                                size_t n) {
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    __m512i start = _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)crc), 0);
    x0 = _mm512_xor_si512(x0, start);
    p += FOLD_ROUND;
    n -= FOLD_ROUND;
    const __m512i k = _mm512_set_epi64(
        (long long)fold_round_k[1], (long long)fold_round_k[0], (long long)fold_round_k[1],
        (long long)fold_round_k[0], (long long)fold_round_k[1], (long long)fold_round_k[0],
        (long long)fold_round_k[1], (long long)fold_round_k[0]);
    while (n >= FOLD_ROUND) {
        x0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x0, k, 0x00),
                                       _mm512_clmulepi64_epi128(x0, k, 0x11),
                                       _mm512_loadu_si512((const void *)p), 0x96);
        x1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x1, k, 0x00),
                                       _mm512_clmulepi64_epi128(x1, k, 0x11),
                                       _mm512_loadu_si512((const void *)(p + 64)), 0x96);
        x2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x2, k, 0x00),
                                       _mm512_clmulepi64_epi128(x2, k, 0x11),
                                       _mm512_loadu_si512((const void *)(p + 128)), 0x96);
        x3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x3, k, 0x00),
                                       _mm512_clmulepi64_epi128(x3, k, 0x11),
                                       _mm512_loadu_si512((const void *)(p + 192)), 0x96);
        p += FOLD_ROUND;
        n -= FOLD_ROUND;
    }
    /* Every lane onto lane 15 (whose own key is 0: it is XORed in as it is). */
    __m512i sum = _mm512_ternarylogic_epi64(fold_lanes(x0, fold_lane_keys(0)),
                                            fold_lanes(x1, fold_lane_keys(4)),
                                            fold_lanes(x2, fold_lane_keys(8)), 0x96);
    sum = _mm512_xor_si512(sum, fold_lanes(x3, fold_lane_keys(12)));
    __m128i z = _mm_xor_si128(
        _mm_xor_si128(_mm512_extracti32x4_epi32(sum, 0), _mm512_extracti32x4_epi32(sum, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(sum, 2), _mm512_extracti32x4_epi32(sum, 3)));
    z = _mm_xor_si128(z, _mm512_extracti32x4_epi32(x3, 3));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(z));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(z, 1));
    return crc_x86((uint32_t)c, p, n);
}
#endif

/* Raw register update: dispatch once per call. */
static uint32_t crc_update(uint32_t crc, const void *data, size_t n) {
#ifdef HAVE_X86_FOLD
    if (crc_fold && n >= FOLD_MIN) return crc_folded(crc, (const uint8_t *)data, n);
#endif
#ifdef HAVE_X86_CRC
    if (crc_hw) return crc_x86(crc, (const uint8_t *)data, n);
#endif
    return crc_sw(crc, (const uint8_t *)data, n);
}

/* The 3-lane CRC-instruction loop only (for tests: the folding path's oracle on this CPU). */
static uint32_t crc_update_no_fold(uint32_t crc, const void *data, size_t n) {
#ifdef HAVE_X86_CRC
    if (crc_hw) return crc_x86(crc, (const uint8_t *)data, n);
#endif
    return crc_sw(crc, (const uint8_t *)data, n);
}

/* ------------------------------------------------------------------------------------------
 * The connection: an fd, a bounded wait, and a small read buffer for reply lines.
 * ---------------------------------------------------------------------------------------- */

#define RBUF_BYTES (64 * 1024)      /* reply lines and the bytes that arrive with them */
#define MAX_LINE (RBUF_BYTES - 1)   /* a reply line longer than this is a protocol error */
#define SCRATCH_BYTES (256 * 1024)  /* bytes that are received only to be dropped or CRC'd */
#define MAX_IOV 1024                /* Linux IOV_MAX */
#define MAX_CONNS 64                /* a job's connections */
#define MAX_VALUE (512ll << 20)     /* Redis' proto-max-bulk-len default: longer is bogus */

enum fail_kind { FAIL_NONE, FAIL_TIMEOUT, FAIL_EOF, FAIL_OS, FAIL_PROTOCOL, FAIL_MEMORY };

struct feed_s; /* a load connection's commands yet to send (feed_t, below) */

typedef struct {
    int fd;
    int timeout_ms;
    int64_t deadline_ns; /* CLOCK_MONOTONIC; 0: the call has no deadline */
    char *rbuf; /* RBUF_BYTES: bytes [rpos, rlen) are received and not consumed */
    size_t rpos, rlen;
    uint8_t *scratch;
    enum fail_kind fail;
    int fail_errno;
    char fail_msg[200];
    struct feed_s *feed; /* a load's: one more command sent per reply line read; or NULL */
} conn_t;

static int conn_failed(conn_t *c, enum fail_kind kind, int err, const char *msg) {
    c->fail = kind;
    c->fail_errno = err;
    snprintf(c->fail_msg, sizeof c->fail_msg, "%s", msg);
    return -1;
}

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Wait until the fd is ready for ``events``, at most timeout_ms and at most until the call's
 * deadline. */
static int conn_wait(conn_t *c, short events) {
    struct pollfd pfd = {.fd = c->fd, .events = events, .revents = 0};
    for (;;) {
        int wait_ms = c->timeout_ms;
        int capped = 0; /* the deadline, not timeout_ms, bounds this wait */
        if (c->deadline_ns) {
            int64_t left_ns = c->deadline_ns - monotonic_ns();
            if (left_ns <= 0)
                return conn_failed(c, FAIL_TIMEOUT, 0,
                                   "Redis did not finish the job within its deadline");
            int64_t left_ms = (left_ns + 999999) / 1000000;
            if (left_ms < wait_ms) {
                wait_ms = (int)left_ms;
                capped = 1;
            }
        }
        int ready = poll(&pfd, 1, wait_ms);
        if (ready > 0) return 0;
        if (ready == 0) {
            if (capped) continue; /* the next round reports the deadline */
            return conn_failed(c, FAIL_TIMEOUT, 0, "Redis did not answer within the timeout");
        }
        if (errno != EINTR) return conn_failed(c, FAIL_OS, errno, "poll");
    }
}

/* recvmsg into ``iov`` (MSG_DONTWAIT, waits when nothing is there). Returns bytes > 0. */
static ssize_t conn_recv(conn_t *c, struct iovec *iov, int niov) {
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)niov;
    for (;;) {
        ssize_t got = recvmsg(c->fd, &msg, MSG_DONTWAIT);
        if (got > 0) return got;
        if (got == 0) return conn_failed(c, FAIL_EOF, 0, "connection closed by Redis");
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return conn_failed(c, FAIL_OS, errno, "recv");
        if (conn_wait(c, POLLIN) < 0) return -1;
    }
}

/* sendmsg all of ``iov`` (modified in place as it is consumed). */
static int conn_send(conn_t *c, struct iovec *iov, int niov) {
    while (niov > 0) {
        if (iov->iov_len == 0) { /* sendmsg of only empty pieces would send nothing */
            iov++;
            niov--;
            continue;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)(niov < MAX_IOV ? niov : MAX_IOV);
        ssize_t sent = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return conn_failed(c, FAIL_OS, errno, "send");
            if (conn_wait(c, POLLOUT) < 0) return -1;
            continue;
        }
        while (niov > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

/* Receive more bytes into the read buffer (compacting it first). */
static int conn_fill(conn_t *c) {
    if (c->rpos > 0) {
        memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
    }
    if (c->rlen >= RBUF_BYTES) return conn_failed(c, FAIL_PROTOCOL, 0, "reply line too long");
    struct iovec iov = {.iov_base = c->rbuf + c->rlen, .iov_len = RBUF_BYTES - c->rlen};
    ssize_t got = conn_recv(c, &iov, 1);
    if (got < 0) return -1;
    c->rlen += (size_t)got;
    return 0;
}

/* The next reply line, without its CRLF: [*line, *line + *len), valid until the next read. */
static int conn_line(conn_t *c, const char **line, size_t *len) {
    size_t scanned = c->rpos;
    for (;;) {
        for (size_t i = scanned; i + 1 < c->rlen; i++) {
            if (c->rbuf[i] == '\r' && c->rbuf[i + 1] == '\n') {
                *line = c->rbuf + c->rpos;
                *len = i - c->rpos;
                c->rpos = i + 2;
                return 0;
            }
        }
        size_t seen = c->rlen > c->rpos ? c->rlen - c->rpos : 0;
        if (seen > MAX_LINE) return conn_failed(c, FAIL_PROTOCOL, 0, "reply line too long");
        size_t offset = seen ? seen - 1 : 0; /* a '\r' may be the last byte seen */
        if (conn_fill(c) < 0) return -1;
        scanned = c->rpos + offset;
    }
}

/* The CRLF that ends a bulk string. */
static int conn_crlf(conn_t *c) {
    while (c->rlen - c->rpos < 2)
        if (conn_fill(c) < 0) return -1;
    if (c->rbuf[c->rpos] != '\r' || c->rbuf[c->rpos + 1] != '\n')
        return conn_failed(c, FAIL_PROTOCOL, 0, "bulk string not terminated by CRLF");
    c->rpos += 2;
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Segments: where the next bytes of the stream go. A segment with ``scratch`` set receives
 * into the connection's scratch buffer (bytes that are dropped, or only checksummed).
 * ---------------------------------------------------------------------------------------- */

typedef struct {
    uint8_t *ptr;
    size_t len;
    int scratch;
} seg_t;

typedef struct {
    uint32_t crc; /* raw register */
    int on;       /* checksum the bytes as they land */
} crc_acc_t;

static void acc_add(crc_acc_t *acc, const uint8_t *p, size_t n) {
    if (acc && acc->on && n) acc->crc = crc_update(acc->crc, p, n);
}

/* Fill one segment list in order from the stream: first from the read buffer, then with
 * recvmsg straight into the segments. When the iovec list reaches the end of the segments the
 * read buffer rides along as the last iovec, so the bytes after the value (its CRLF, the next
 * reply's line and the start of its body) come in the same call. Scratch segments end an
 * iovec list (two of them would alias the one scratch buffer before their bytes are used). */
static int conn_recv_segments(conn_t *c, seg_t *segs, size_t nseg, crc_acc_t *acc) {
    size_t si = 0, off = 0; /* cursor: segment index, offset inside it */
    struct iovec iov[MAX_IOV];
    while (si < nseg) {
        if (off == segs[si].len) {
            si++;
            off = 0;
            continue;
        }
        size_t have = c->rlen - c->rpos;
        if (have) { /* bytes already buffered */
            uint8_t *dst = segs[si].scratch ? c->scratch : segs[si].ptr + off;
            size_t room = segs[si].len - off;
            if (segs[si].scratch && room > SCRATCH_BYTES) room = SCRATCH_BYTES;
            size_t n = have < room ? have : room;
            memcpy(dst, c->rbuf + c->rpos, n);
            acc_add(acc, dst, n);
            c->rpos += n;
            off += n;
            continue;
        }
        c->rpos = c->rlen = 0;
        int niov = 0;
        size_t sj = si, so = off;
        int to_end = 0;
        while (niov < MAX_IOV - 1) { /* one iovec is kept for the read buffer */
            size_t room = segs[sj].len - so;
            if (segs[sj].scratch) {
                if (room > SCRATCH_BYTES) room = SCRATCH_BYTES;
                iov[niov].iov_base = c->scratch;
            } else {
                iov[niov].iov_base = segs[sj].ptr + so;
            }
            iov[niov++].iov_len = room;
            int partial_scratch = segs[sj].scratch && so + room < segs[sj].len;
            sj++;
            so = 0;
            while (sj < nseg && segs[sj].len == 0) sj++;
            if (sj == nseg && !partial_scratch) {
                to_end = 1;
                break;
            }
            if (iov[niov - 1].iov_base == c->scratch) break;
        }
        int total_iov = niov;
        if (to_end) {
            iov[total_iov].iov_base = c->rbuf;
            iov[total_iov++].iov_len = RBUF_BYTES;
        }
        ssize_t got = conn_recv(c, iov, total_iov);
        if (got < 0) return -1;
        size_t left = (size_t)got;
        /* Advance the cursor over what landed, checksumming it while it is in the cache. */
        for (int k = 0; k < niov && left; k++) {
            size_t n = left < iov[k].iov_len ? left : iov[k].iov_len;
            acc_add(acc, (const uint8_t *)iov[k].iov_base, n);
            left -= n;
            off += n;
            while (si < nseg && off == segs[si].len) {
                si++;
                off = 0;
            }
        }
        c->rlen = left; /* what spilled into the read buffer */
    }
    return 0;
}

/* Drop the next ``n`` bytes of the stream (bounded scratch, never held whole). */
static int conn_drain(conn_t *c, size_t n) {
    seg_t seg = {.ptr = NULL, .len = n, .scratch = 1};
    return conn_recv_segments(c, &seg, 1, NULL);
}

/* ------------------------------------------------------------------------------------------
 * Replies
 * ---------------------------------------------------------------------------------------- */

enum reply_kind { R_BULK, R_NIL, R_ERROR, R_STATUS, R_INT };

typedef struct {
    enum reply_kind kind;
    long long len;    /* R_BULK: bytes that follow; R_INT: the integer */
    char *text;       /* R_ERROR / R_STATUS: malloc'd, NUL-terminated */
} reply_t;

static int parse_len(const char *p, size_t n, long long *out) {
    if (n == 0 || n > 18) return -1;
    long long v = 0;
    int neg = 0;
    size_t i = 0;
    if (p[0] == '-') {
        neg = 1;
        i = 1;
        if (n == 1) return -1;
    }
    for (; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        v = v * 10 + (p[i] - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

/* Read one reply's first line. A bulk string's body is left in the stream. */
static int read_reply_line_only(conn_t *c, reply_t *r) {
    const char *line;
    size_t len;
    r->text = NULL;
    if (conn_line(c, &line, &len) < 0) return -1;
    if (len == 0) return conn_failed(c, FAIL_PROTOCOL, 0, "empty reply line");
    switch (line[0]) {
    case '$': {
        long long n;
        if (parse_len(line + 1, len - 1, &n) < 0 || n < -1 || n > MAX_VALUE)
            return conn_failed(c, FAIL_PROTOCOL, 0, "bad bulk length");
        r->kind = n < 0 ? R_NIL : R_BULK;
        r->len = n;
        return 0;
    }
    case ':': {
        long long n;
        if (parse_len(line + 1, len - 1, &n) < 0)
            return conn_failed(c, FAIL_PROTOCOL, 0, "bad integer reply");
        r->kind = R_INT;
        r->len = n;
        return 0;
    }
    case '_': /* RESP3 null */
        if (len != 1) return conn_failed(c, FAIL_PROTOCOL, 0, "bad RESP3 null");
        r->kind = R_NIL;
        return 0;
    case '-':
    case '+':
        r->kind = line[0] == '-' ? R_ERROR : R_STATUS;
        r->text = malloc(len);
        if (!r->text) return conn_failed(c, FAIL_MEMORY, 0, "out of memory");
        memcpy(r->text, line + 1, len - 1);
        r->text[len - 1] = '\0';
        return 0;
    default:
        return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected reply type");
    }
}

/* ------------------------------------------------------------------------------------------
 * load_values
 * ---------------------------------------------------------------------------------------- */

#define PREFIX_BYTES 48
#define CRC_OFFSET 12
#define HLEN_OFFSET 8

enum load_status { L_OK, L_MISSING, L_OVERSIZED, L_ERROR, L_MISMATCH };
enum landed { LAND_NONE, LAND_PAGES, LAND_STAGING };
static const char *const load_status_names[] = {"ok", "missing", "oversized", "error",
                                                "layout-mismatch"};

typedef struct {
    /* inputs (buffers held for the call) */
    Py_buffer command;
    Py_buffer head;
    Py_buffer expected;
    Py_buffer prefix; /* optional: the bytes a matching value's prefix starts with */
    Py_buffer staging;
    int has_staging;
    seg_t *dests; /* body destinations in order; scratch segments are skipped bytes */
    size_t ndest;
    Py_buffer *dest_views; /* the Py_buffers behind the non-scratch dests */
    size_t nviews;
    long long body_len;
    long long max_len;
    long long piece; /* P: the bytes each GETRANGE asks for (load_values' piece_bytes) */
    size_t pieces;   /* 0: one GET; else STRLEN then this many GETRANGEs (see value_t) */
    /* outputs */
    enum load_status status;
    long long value_len;
    long long header_len;
    int crc_ok;
    enum landed landed;
    char *error; /* L_ERROR: malloc'd message */
} target_t;

static uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* ------------------------------------------------------------------------------------------
 * A load connection's commands, fed one per reply: the commands of targets first, first +
 * stride, ... below end, in order, one RESP command at a time (a pieced target's STRLEN and
 * each of its GETRANGEs apart), at most ``window`` unanswered: each reply line read sends the
 * next. So Redis holds at most ``window`` replies for the connection in its output buffer: with
 * pieces of 4 or 8 MiB values, two pieces rather than two whole values (a fresh server
 * faulted in 2 070 pages for 32 values of 4 MiB with whole values' commands sent together,
 * 520-780 with two pieces; docs/performance.md, issue 39).
 * ---------------------------------------------------------------------------------------- */

typedef struct feed_s {
    target_t *targets;
    size_t next, stride, end; /* the target whose commands go next */
    size_t off;               /* bytes of its command buffer already sent */
} feed_t;

/* ``*p`` at ``type`` then a length >= 0 and CRLF in buf[0, len): the length, *p past the CRLF. */
static int command_field(const char *buf, size_t len, size_t *p, char type, long long *out) {
    if (*p >= len || buf[*p] != type) return -1;
    size_t start = *p + 1;
    const char *cr = memchr(buf + start, '\r', len - start);
    if (!cr) return -1;
    size_t at = (size_t)(cr - buf);
    if (at + 1 >= len || buf[at + 1] != '\n') return -1;
    if (parse_len(buf + start, at - start, out) < 0 || *out < 0) return -1;
    *p = at + 2;
    return 0;
}

/* The end of the command (a RESP array of bulk strings) at ``off`` in buf[0, len); ``len``
 * when what is there is not one (the rest then goes as one command). */
static size_t command_end(const char *buf, size_t len, size_t off) {
    size_t p = off;
    long long n;
    if (command_field(buf, len, &p, '*', &n) < 0) return len;
    for (long long i = 0; i < n; i++) {
        long long l;
        if (command_field(buf, len, &p, '$', &l) < 0 || (size_t)l > len - p ||
            len - p - (size_t)l < 2)
            return len;
        p += (size_t)l + 2;
    }
    return p;
}

/* Send the connection's next ``count`` commands (fewer when fewer are left), in one sendmsg
 * batch per MAX_IOV. */
static int feed_send(conn_t *c, size_t count) {
    feed_t *f = c->feed;
    struct iovec iov[MAX_IOV];
    int n = 0;
    while (count > 0 && f->next < f->end) {
        target_t *t = &f->targets[f->next];
        const char *buf = t->command.buf;
        size_t len = (size_t)t->command.len;
        size_t to = f->off < len ? command_end(buf, len, f->off) : len;
        iov[n].iov_base = (void *)(buf + f->off);
        iov[n].iov_len = to - f->off;
        n++;
        count--;
        f->off = to;
        if (f->off >= len) {
            f->next += f->stride;
            f->off = 0;
        }
        if (n == MAX_IOV) {
            if (conn_send(c, iov, n) < 0) return -1;
            n = 0;
        }
    }
    return n ? conn_send(c, iov, n) : 0;
}

/* Start feeding the connection targets first, first + stride, ... below end: ``window``
 * commands now (0: all of them). */
static int feed_start(conn_t *c, feed_t *f, target_t *targets, size_t first, size_t stride,
                      size_t end, size_t window) {
    *f = (feed_t){.targets = targets, .next = first, .stride = stride, .end = end};
    c->feed = f;
    return feed_send(c, window ? window : SIZE_MAX);
}

/* Read one reply's first line; on a fed connection, send its next command. */
static int read_reply_line(conn_t *c, reply_t *r) {
    if (read_reply_line_only(c, r) < 0) return -1;
    if (c->feed && feed_send(c, 1) < 0) {
        free(r->text);
        r->text = NULL;
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * A value's bytes as one stream. A GET's value is one bulk string. A value read in pieces
 * (a target with ``pieces``: ``STRLEN key`` then ``GETRANGE key i*P (i+1)*P-1`` for i below
 * ``pieces``, the last one ending at max_len - 1) arrives as that many bulk strings: STRLEN's
 * integer N says how long each should be (P, then what is left of N, then empty ones). A piece
 * of another length (or a nil or an error in its place) means the key changed between the
 * commands, or a piece was refused: the value is then ``changed`` and its receiver fills
 * nothing more (the caller reports it missing, or the first piece's error); every piece is
 * still consumed, by its own length, in value_finish.
 * ---------------------------------------------------------------------------------------- */

typedef struct {
    conn_t *c;
    long long piece;     /* P; 0: one bulk string whose body is the value */
    size_t left;         /* bytes left in the current piece's body */
    size_t pieces_left;  /* piece replies not yet read */
    long long unclaimed; /* value bytes no piece read so far has carried */
    int owe_crlf;        /* the current piece's CRLF is unread */
    int changed;
    char *error;         /* the first error reply in a piece's place (malloc'd), or NULL */
} value_t;

/* Read the next piece's reply line: the bytes it carries become ``left``. */
static int value_next_piece(value_t *v) {
    conn_t *c = v->c;
    if (v->owe_crlf && conn_crlf(c) < 0) return -1;
    v->owe_crlf = 0;
    if (v->pieces_left == 0) /* N <= max_len <= the pieces' reach: only a bug lands here */
        return conn_failed(c, FAIL_PROTOCOL, 0, "a value outgrew the pieces asked for");
    reply_t r;
    if (read_reply_line(c, &r) < 0) return -1;
    v->pieces_left--;
    if (r.kind == R_NIL || r.kind == R_ERROR) { /* gone, moved or refused since STRLEN */
        if (r.kind == R_ERROR && !v->error)
            v->error = r.text;
        else
            free(r.text);
        v->changed = 1;
        return 0;
    }
    if (r.kind != R_BULK) {
        free(r.text);
        return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected reply to GETRANGE");
    }
    long long want = v->unclaimed < v->piece ? v->unclaimed : v->piece;
    if (r.len != want) v->changed = 1;
    v->unclaimed -= want;
    v->left = (size_t)r.len;
    v->owe_crlf = 1;
    return 0;
}

/* Fill ``segs`` in order with the value's next bytes (CRC32C into ``acc``); nothing once the
 * value has changed. */
static int value_recv(value_t *v, seg_t *segs, size_t nseg, crc_acc_t *acc) {
    if (!v->piece) return conn_recv_segments(v->c, segs, nseg, acc);
    size_t i = 0, off = 0;
    while (i < nseg) {
        if (off == segs[i].len) {
            i++;
            off = 0;
            continue;
        }
        if (v->changed) return 0;
        if (v->left == 0) {
            if (value_next_piece(v) < 0) return -1;
            continue;
        }
        if (off == 0) { /* the whole segments that fit in this piece, in one call */
            size_t j = i, sum = 0;
            while (j < nseg && sum + segs[j].len <= v->left) sum += segs[j++].len;
            if (j > i) {
                if (conn_recv_segments(v->c, segs + i, j - i, acc) < 0) return -1;
                v->left -= sum;
                i = j;
                continue;
            }
        }
        size_t n = segs[i].len - off;
        if (n > v->left) n = v->left;
        seg_t part = {.ptr = segs[i].scratch ? NULL : segs[i].ptr + off, .len = n,
                      .scratch = segs[i].scratch};
        if (conn_recv_segments(v->c, &part, 1, acc) < 0) return -1;
        v->left -= n;
        off += n;
    }
    return 0;
}

/* Drop the value's next ``n`` bytes. */
static int value_drain(value_t *v, size_t n) {
    seg_t seg = {.ptr = NULL, .len = n, .scratch = 1};
    return value_recv(v, &seg, 1, NULL);
}

/* Consume the rest of the value's replies: the current piece and every piece not yet read,
 * each by its own length; then the stream is at the next target's reply. */
static int value_finish(value_t *v) {
    if (!v->piece) return conn_crlf(v->c);
    for (;;) {
        if (v->left && conn_drain(v->c, v->left) < 0) return -1;
        v->left = 0;
        if (v->pieces_left == 0) break;
        if (value_next_piece(v) < 0) return -1;
    }
    return v->owe_crlf ? conn_crlf(v->c) : 0;
}

/* Receive a value of ``len`` bytes (its length known: a bulk string's line, or STRLEN's reply)
 * into one target, following the rules in wire.py's docstring. Invariant: exactly ``len``
 * bytes of the value's stream are consumed on success, whatever the outcome (none after it
 * changed). */
static int receive_value(value_t *v, target_t *t, long long len) {
    uint8_t *head = t->head.buf;
    size_t got = (size_t)(len < PREFIX_BYTES ? len : PREFIX_BYTES);
    crc_acc_t acc = {.crc = 0xFFFFFFFFu, .on = 0};
    seg_t seg = {.ptr = head, .len = got, .scratch = 0};
    t->value_len = len;
    t->header_len = -1;
    if (value_recv(v, &seg, 1, NULL) < 0) return -1;
    int matched = 0;
    if (len >= PREFIX_BYTES && !v->changed) {
        long long hlen = be32(head + HLEN_OFFSET);
        t->header_len = hlen;
        if (PREFIX_BYTES + hlen <= len && PREFIX_BYTES + hlen <= (long long)t->head.len) {
            acc.on = 1;
            seg.ptr = head + PREFIX_BYTES;
            seg.len = (size_t)hlen;
            if (value_recv(v, &seg, 1, &acc) < 0) return -1;
            got += (size_t)hlen;
            matched = hlen == (long long)t->expected.len &&
                      memcmp(head + PREFIX_BYTES, t->expected.buf, (size_t)hlen) == 0 &&
                      (!t->prefix.obj || memcmp(head, t->prefix.buf, (size_t)t->prefix.len) == 0);
        }
    }
    if (matched && len == (long long)got + t->body_len) {
        /* The header is the expected one: the body goes to its pages. */
        if (value_recv(v, t->dests, t->ndest, &acc) < 0) return -1;
        t->landed = LAND_PAGES;
    } else if (!matched && t->has_staging && len <= (long long)t->staging.len) {
        /* Anything else Python decodes: the whole value in staging. */
        uint8_t *staging = t->staging.buf;
        /* memmove: staging may be the very buffer head is a view of (the transfer engine
         * gives one buffer for both). */
        memmove(staging, head, got);
        seg.ptr = staging + got;
        seg.len = (size_t)len - got;
        if (value_recv(v, &seg, 1, &acc) < 0) return -1;
        t->landed = LAND_STAGING;
    } else {
        t->status = L_MISMATCH;
        return value_drain(v, (size_t)len - got);
    }
    t->status = L_OK;
    if (len >= PREFIX_BYTES && !v->changed) {
        if (!acc.on) { /* the header did not fit the head: checksum the staged copy */
            acc.crc = crc_update(0xFFFFFFFFu, (const uint8_t *)t->staging.buf + PREFIX_BYTES,
                                 (size_t)len - PREFIX_BYTES);
        }
        t->crc_ok = (acc.crc ^ 0xFFFFFFFFu) == be32(head + CRC_OFFSET);
    }
    return 0;
}

/* A value read in pieces, STRLEN's reply ``r`` read: missing (0), oversized, an error, or
 * received; then every piece is consumed. A value that changed between the commands is
 * reported missing (recomputed, not deleted: it may be a valid value written meanwhile); an
 * error reply in a piece's place (NOPERM: no GETRANGE; MOVED, ASK) is the target's error. */
static int take_pieces(conn_t *c, target_t *t, reply_t *r) {
    value_t v = {.c = c, .piece = t->piece, .pieces_left = t->pieces};
    if (r->kind == R_ERROR) {
        t->status = L_ERROR;
        t->error = r->text;
    } else if (r->kind != R_INT) {
        free(r->text);
        return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected reply to STRLEN");
    } else if (r->len < 0 || r->len > MAX_VALUE) {
        return conn_failed(c, FAIL_PROTOCOL, 0, "bad STRLEN reply");
    } else if (r->len == 0) {
        t->status = L_MISSING;
    } else if (r->len > t->max_len) {
        t->status = L_OVERSIZED;
        t->value_len = r->len;
        v.unclaimed = t->max_len; /* the pieces carry max_len bytes, dropped */
        if (value_drain(&v, (size_t)t->max_len) < 0) goto failed;
    } else {
        v.unclaimed = r->len;
        if (receive_value(&v, t, r->len) < 0) goto failed;
    }
    if (value_finish(&v) < 0) goto failed;
    if (v.changed && t->status != L_ERROR) {
        t->status = v.error ? L_ERROR : L_MISSING;
        t->error = v.error;
        v.error = NULL;
        t->landed = LAND_NONE;
        t->crc_ok = 0;
        t->header_len = -1;
        t->value_len = 0;
    }
    free(v.error);
    return 0;
failed:
    free(v.error);
    return -1;
}

/* The rest of one target's reply, its first line ``r`` read: the value lands (or is drained),
 * or the target records the nil or the error (which it then owns). */
static int take_reply(conn_t *c, target_t *t, reply_t *r) {
    if (t->pieces) return take_pieces(c, t, r);
    switch (r->kind) {
    case R_NIL:
        t->status = L_MISSING;
        return 0;
    case R_ERROR:
        t->status = L_ERROR;
        t->error = r->text;
        return 0;
    case R_STATUS:
        free(r->text);
        return conn_failed(c, FAIL_PROTOCOL, 0, "status reply to GET");
    case R_INT:
        return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected reply type");
    case R_BULK:
        break;
    }
    value_t v = {.c = c};
    if (r->len > t->max_len) {
        t->status = L_OVERSIZED;
        t->value_len = r->len;
        if (conn_drain(c, (size_t)r->len) < 0) return -1;
    } else if (receive_value(&v, t, r->len) < 0) {
        return -1;
    }
    return conn_crlf(c);
}

/* Every connection of the job ends at a reply boundary with nothing unread (else *failed is the
 * one holding bytes past its last reply). */
static int conns_drained(conn_t *cs, size_t k, size_t *failed) {
    for (size_t j = 0; j < k; j++) {
        *failed = j;
        if (cs[j].rlen != cs[j].rpos)
            return conn_failed(&cs[j], FAIL_PROTOCOL, 0, "unexpected bytes after the last reply");
    }
    return 0;
}

/* The whole job on the calling thread alone (load_values' ``one_thread``, an A/B switch for
 * benchmarks), on ``k`` connections: target i travels on connection i % k, and replies are read
 * in target order. At most ``window`` commands per connection are unanswered at once (0: all
 * sent first); the next is sent as soon as a reply's first line arrives (feed_t), so Redis
 * prepares it (and the other connections' replies) while this value is received. On failure
 * *failed is the connection that failed. */
static int run_loads_fed(conn_t *cs, size_t k, target_t *targets, size_t n, size_t window,
                         size_t *failed, feed_t *feeds) {
    for (size_t j = 0; j < k && j < n; j++) {
        *failed = j;
        if (feed_start(&cs[j], &feeds[j], targets, j, k, n, window) < 0) return -1;
    }
    for (size_t i = 0; i < n; i++) {
        conn_t *c = &cs[i % k];
        *failed = i % k;
        reply_t r;
        if (read_reply_line(c, &r) < 0) return -1;
        if (take_reply(c, &targets[i], &r) < 0) return -1;
    }
    return conns_drained(cs, k, failed);
}

static int run_loads(conn_t *cs, size_t k, target_t *targets, size_t n, size_t window,
                     size_t *failed) {
    feed_t feeds[MAX_CONNS];
    int rc = run_loads_fed(cs, k, targets, n, window, failed, feeds);
    for (size_t j = 0; j < k; j++) cs[j].feed = NULL; /* the feeds go with this frame */
    return rc;
}

/* One connection's part of a job: targets first, first + stride, ... below n, read in that
 * order, at most ``window`` commands unanswered at once (0: all sent first; feed_t). */
static int run_lane_fed(conn_t *c, feed_t *feed, target_t *targets, size_t first, size_t n,
                        size_t stride, size_t window) {
    if (feed_start(c, feed, targets, first, stride, n, window) < 0) return -1;
    for (size_t i = first; i < n; i += stride) {
        reply_t r;
        if (read_reply_line(c, &r) < 0) return -1;
        if (take_reply(c, &targets[i], &r) < 0) return -1;
    }
    if (c->rlen != c->rpos)
        return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected bytes after the last reply");
    return 0;
}

static int run_lane(conn_t *c, target_t *targets, size_t first, size_t n, size_t stride,
                    size_t window) {
    feed_t feed;
    int rc = run_lane_fed(c, &feed, targets, first, n, stride, window);
    c->feed = NULL; /* the feed goes with this frame */
    return rc;
}

/* A load job with a thread per connection: connection j's lane (targets j, j + k, ...) runs on
 * a thread of its own, lane 0 on the calling thread. Each thread blocks only on its own socket,
 * so one receives while Redis prepares another's reply, with no thread waiting on a reply that
 * another connection's bytes already stand behind (two cores: 512 KiB loads 1.25x those of one
 * thread reading both connections in turn; docs/performance.md). The first lane to fail shuts
 * the other connections down, so their threads stop at once rather than wait out a timeout
 * (the caller drops every connection of a failed job); every thread is joined before this
 * returns, so no page is written after the call. A thread that cannot be started leaves its
 * lane to the calling thread, after lane 0. */
typedef struct {
    conn_t *cs;
    size_t k; /* lanes: connections that carry a target */
    size_t stride; /* connections of the job: target i travels on connection i % stride */
    target_t *targets;
    size_t n, window;
    int first_failed; /* -1, or the lane whose failure the job reports */
} lanes_t;

typedef struct {
    lanes_t *lanes;
    size_t index;
    pthread_t thread;
    int started;
} lane_arg_t;

#define LANE_STACK_BYTES (256 * 1024) /* two iovec arrays of MAX_IOV and small frames */

static void lane_run(lanes_t *ls, size_t j) {
    if (run_lane(&ls->cs[j], ls->targets, j, ls->n, ls->stride, ls->window) == 0) return;
    int none = -1;
    if (__atomic_compare_exchange_n(&ls->first_failed, &none, (int)j, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
        for (size_t q = 0; q < ls->k; q++)
            if (q != j) shutdown(ls->cs[q].fd, SHUT_RDWR);
    }
}

static void *lane_main(void *arg) {
    lane_arg_t *a = arg;
    lane_run(a->lanes, a->index);
    return NULL;
}

static int run_loads_on_threads(conn_t *cs, size_t k, target_t *targets, size_t n,
                                size_t window, size_t *failed) {
    lanes_t ls = {.cs = cs, .k = k < n ? k : n, .stride = k, .targets = targets, .n = n,
                  .window = window, .first_failed = -1};
    lane_arg_t args[MAX_CONNS];
    pthread_attr_t attr;
    int attr_ok = pthread_attr_init(&attr) == 0;
    if (attr_ok) pthread_attr_setstacksize(&attr, LANE_STACK_BYTES);
    for (size_t j = 1; j < ls.k; j++) {
        args[j].lanes = &ls;
        args[j].index = j;
        args[j].started =
            pthread_create(&args[j].thread, attr_ok ? &attr : NULL, lane_main, &args[j]) == 0;
    }
    if (attr_ok) pthread_attr_destroy(&attr);
    if (ls.k > 0) lane_run(&ls, 0);
    for (size_t j = 1; j < ls.k; j++) {
        if (args[j].started)
            pthread_join(args[j].thread, NULL);
        else
            lane_run(&ls, j);
    }
    if (ls.first_failed >= 0) {
        *failed = (size_t)ls.first_failed;
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Python glue
 * ---------------------------------------------------------------------------------------- */

static PyObject *ProtocolError;

static int conn_open(conn_t *c, int fd, double timeout_s, double budget_s) {
    memset(c, 0, sizeof *c);
    c->fd = fd;
    if (!(timeout_s > 0) || timeout_s > 86400.0) {
        PyErr_SetString(PyExc_ValueError, "timeout_s must be > 0 and at most a day");
        return -1;
    }
    if (!(budget_s >= 0) || budget_s > 86400.0) {
        PyErr_SetString(PyExc_ValueError, "budget_s must be >= 0 and at most a day");
        return -1;
    }
    c->timeout_ms = (int)(timeout_s * 1000.0 + 0.999);
    if (budget_s > 0) c->deadline_ns = monotonic_ns() + (int64_t)(budget_s * 1e9);
    c->rbuf = PyMem_RawMalloc(RBUF_BYTES);
    c->scratch = PyMem_RawMalloc(SCRATCH_BYTES);
    if (!c->rbuf || !c->scratch) {
        PyMem_RawFree(c->rbuf);
        PyMem_RawFree(c->scratch);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void conn_close(conn_t *c) {
    PyMem_RawFree(c->rbuf);
    PyMem_RawFree(c->scratch);
}

/* ``fd``: one int, or a sequence of 1..MAX_CONNS ints (a job's connections). */
static int conns_open(PyObject *fd, conn_t *cs, size_t *k, double timeout_s, double budget_s) {
    int fds[MAX_CONNS];
    size_t n = 0;
    if (PyLong_Check(fd)) {
        fds[n++] = (int)PyLong_AsLong(fd);
        if (PyErr_Occurred()) return -1;
    } else {
        PyObject *seq = PySequence_Fast(fd, "fd must be an int or a sequence of ints");
        if (!seq) return -1;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
        if (m < 1 || m > MAX_CONNS) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "a job runs on 1 to 64 connections");
            return -1;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            fds[n++] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
        }
        Py_DECREF(seq);
    }
    for (size_t j = 0; j < n; j++) {
        for (size_t q = 0; q < j; q++) {
            if (fds[q] == fds[j]) { /* two readers of one stream would split its replies */
                PyErr_SetString(PyExc_ValueError, "a job's connections must be distinct");
                return -1;
            }
        }
    }
    for (size_t j = 0; j < n; j++) {
        if (conn_open(&cs[j], fds[j], timeout_s, budget_s) < 0) {
            while (j--) conn_close(&cs[j]);
            return -1;
        }
    }
    *k = n;
    return 0;
}

static void conns_close(conn_t *cs, size_t k) {
    for (size_t j = 0; j < k; j++) conn_close(&cs[j]);
}

/* Raise the connection's failure (GIL held). */
static PyObject *conn_raise(conn_t *c) {
    switch (c->fail) {
    case FAIL_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, c->fail_msg);
        break;
    case FAIL_EOF:
        PyErr_SetString(PyExc_ConnectionError, c->fail_msg);
        break;
    case FAIL_OS:
        errno = c->fail_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    case FAIL_MEMORY:
        PyErr_NoMemory();
        break;
    default:
        PyErr_SetString(ProtocolError, c->fail_msg);
    }
    return NULL;
}

static void target_release(target_t *t) {
    if (t->command.obj) PyBuffer_Release(&t->command);
    if (t->head.obj) PyBuffer_Release(&t->head);
    if (t->expected.obj) PyBuffer_Release(&t->expected);
    if (t->prefix.obj) PyBuffer_Release(&t->prefix);
    if (t->staging.obj) PyBuffer_Release(&t->staging);
    for (size_t i = 0; i < t->nviews; i++) PyBuffer_Release(&t->dest_views[i]);
    PyMem_Free(t->dest_views);
    PyMem_Free(t->dests);
    free(t->error);
}

static int get_writable(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable contiguous buffer", what);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Pages (hma_redis.core.medium.Pages): a chunk's body in place, described by a group's page
 * layout and block ids. Each layout's layer memory is taken once per call, however many
 * chunks share it; the pages are cut as Pages.views cuts them, with the same checks.
 * ---------------------------------------------------------------------------------------- */

static PyTypeObject *PagesType; /* hma_redis.core.medium.Pages */

typedef struct {
    PyObject *layout; /* a reference held for the call */
    Py_ssize_t n;     /* layers */
    Py_buffer *views; /* each layer's memory, held for the call */
    long long *page, *row;
} layout_t;

typedef struct {
    layout_t *items;
    size_t n, cap;
} layouts_t;

static void layouts_release(layouts_t *ls) {
    for (size_t i = 0; i < ls->n; i++) {
        layout_t *l = &ls->items[i];
        for (Py_ssize_t j = 0; l->views && j < l->n; j++) PyBuffer_Release(&l->views[j]);
        PyMem_Free(l->views);
        PyMem_Free(l->page);
        Py_DECREF(l->layout);
    }
    PyMem_Free(ls->items);
    memset(ls, 0, sizeof *ls);
}

/* A sequence attribute's items as long longs (*out PyMem'd, *n its length). */
static int attr_ints(PyObject *obj, const char *name, long long **out, Py_ssize_t *n) {
    PyObject *attr = PyObject_GetAttrString(obj, name);
    if (!attr) return -1;
    PyObject *seq = PySequence_Fast(attr, "block ids and page sizes must be sequences");
    Py_DECREF(attr);
    if (!seq) return -1;
    *n = PySequence_Fast_GET_SIZE(seq);
    *out = PyMem_Calloc((size_t)*n + 1, sizeof(long long));
    int rc = *out ? 0 : -1;
    if (!*out) PyErr_NoMemory();
    for (Py_ssize_t i = 0; rc == 0 && i < *n; i++) {
        (*out)[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((*out)[i] == -1 && PyErr_Occurred()) rc = -1;
    }
    Py_DECREF(seq);
    return rc;
}

/* Parse a PageLayout into l (its layers' memory held); the checks of Pages.views. */
static int layout_parse(layout_t *l, PyObject *layout) {
    long long *rows = NULL;
    Py_ssize_t npage = 0, nrow = 0;
    PyObject *layers = PyObject_GetAttrString(layout, "layers");
    PyObject *lseq = layers ? PySequence_Fast(layers, "layers must be a sequence") : NULL;
    Py_XDECREF(layers);
    int rc = -1;
    if (!lseq) return -1;
    if (attr_ints(layout, "page_bytes", &l->page, &npage) < 0) goto done;
    if (attr_ints(layout, "row_bytes", &rows, &nrow) < 0) goto done;
    l->n = PySequence_Fast_GET_SIZE(lseq);
    if (npage != l->n || nrow != l->n) {
        PyErr_SetString(PyExc_ValueError,
                        "a page layout needs one page size and one row size per layer");
        goto done;
    }
    /* page and row sizes side by side in one allocation: page[0..n), row = page + n */
    long long *both = PyMem_Realloc(l->page, ((size_t)l->n * 2 + 1) * sizeof(long long));
    if (!both) {
        PyErr_NoMemory();
        goto done;
    }
    l->page = both;
    l->row = both + l->n;
    memcpy(l->row, rows, (size_t)l->n * sizeof(long long));
    l->views = PyMem_Calloc((size_t)l->n + 1, sizeof(Py_buffer));
    if (!l->views) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < l->n; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(lseq, j), &l->views[j],
                               PyBUF_WRITABLE) < 0) {
            memset(&l->views[j], 0, sizeof(Py_buffer)); /* nothing held: nothing to release */
            PyErr_SetString(PyExc_TypeError, "a layer must be a writable contiguous buffer");
            goto done;
        }
        if (!(l->page[j] > 0 && l->page[j] <= l->row[j])) {
            PyErr_SetString(PyExc_ValueError, "a page must be 1 to row_bytes bytes");
            goto done;
        }
    }
    rc = 0;
done:
    PyMem_Free(rows);
    Py_DECREF(lseq);
    return rc;
}

/* The call's parse of ``layout`` (by identity), parsing it on first sight. */
static layout_t *layouts_get(layouts_t *ls, PyObject *layout) {
    for (size_t i = 0; i < ls->n; i++)
        if (ls->items[i].layout == layout) return &ls->items[i];
    if (ls->n == ls->cap) {
        size_t cap = ls->cap * 2 + 4;
        layout_t *items = PyMem_Realloc(ls->items, cap * sizeof(layout_t));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        ls->items = items;
        ls->cap = cap;
    }
    layout_t *l = &ls->items[ls->n];
    memset(l, 0, sizeof *l);
    Py_INCREF(layout);
    l->layout = layout;
    ls->n++; /* released with the others even when the parse fails */
    return layout_parse(l, layout) < 0 ? NULL : l;
}

/* The segments of one Pages object (*segs PyMem'd), in Pages.views order. */
static int pages_segments(layouts_t *ls, PyObject *pages, seg_t **segs, size_t *nseg) {
    long long *ids = NULL;
    Py_ssize_t nids = 0;
    int rc = -1;
    PyObject *layout = PyObject_GetAttrString(pages, "layout");
    if (!layout) return -1;
    layout_t *l = layouts_get(ls, layout);
    Py_DECREF(layout);
    if (!l || attr_ints(pages, "block_ids", &ids, &nids) < 0) goto done;
    *nseg = 0;
    *segs = PyMem_Calloc((size_t)l->n * (size_t)nids + 1, sizeof(seg_t));
    if (!*segs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < l->n; j++) {
        long long page = l->page[j], row = l->row[j];
        long long len = (long long)l->views[j].len;
        long long last = len < page ? -1 : (len - page) / row; /* the last block that fits */
        uint8_t *base = l->views[j].buf;
        for (Py_ssize_t i = 0; i < nids;) {
            Py_ssize_t end = i + 1; /* a run: ids[i], ids[i] + 1, ... */
            while (end < nids && ids[end - 1] < LLONG_MAX && ids[end] == ids[end - 1] + 1) end++;
            long long first = ids[i], count = end - i;
            if (first < 0 || first > last || count - 1 > last - first) {
                PyErr_SetString(PyExc_ValueError,
                                "a block id puts a page outside its layer's memory");
                goto done;
            }
            if (page == row) {
                (*segs)[(*nseg)++] = (seg_t){base + first * row, (size_t)(count * row), 0};
            } else {
                for (long long b = first; b < first + count; b++)
                    (*segs)[(*nseg)++] = (seg_t){base + b * row, (size_t)page, 0};
            }
            i = end;
        }
    }
    rc = 0;
done:
    PyMem_Free(ids);
    return rc;
}

/* The destinations: a sequence of writable buffers or ints (that many bytes received and
 * dropped), or a Pages object. */
static int target_dests(target_t *t, PyObject *list, layouts_t *ls) {
    if (PyObject_TypeCheck(list, PagesType)) {
        if (pages_segments(ls, list, &t->dests, &t->ndest) < 0) return -1;
        for (size_t i = 0; i < t->ndest; i++) t->body_len += (long long)t->dests[i].len;
        return 0;
    }
    PyObject *seq = PySequence_Fast(list, "dests must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    t->dests = PyMem_Calloc((size_t)n + 1, sizeof(seg_t));
    t->dest_views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    if (!t->dests || !t->dest_views) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        seg_t *seg = &t->dests[t->ndest++];
        if (PyLong_Check(item)) {
            long long skip = PyLong_AsLongLong(item);
            if (skip < 0 || skip > MAX_VALUE) {
                Py_DECREF(seq);
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad skip length");
                return -1;
            }
            seg->len = (size_t)skip;
            seg->scratch = 1;
        } else {
            Py_buffer *view = &t->dest_views[t->nviews];
            if (get_writable(item, view, "a destination") < 0) {
                Py_DECREF(seq);
                return -1;
            }
            t->nviews++;
            seg->ptr = view->buf;
            seg->len = (size_t)view->len;
        }
        t->body_len += (long long)seg->len;
    }
    Py_DECREF(seq);
    return 0;
}

/* Parse one (head, expected_header, dests, staging, max_len[, expected_prefix]) target and its
 * command. */
static int target_parse(target_t *t, PyObject *command, PyObject *spec, layouts_t *ls) {
    PyObject *seq = PySequence_Fast(spec, "a target must be a sequence");
    if (!seq) return -1;
    int rc = -1;
    Py_ssize_t nitems = PySequence_Fast_GET_SIZE(seq);
    if (nitems != 5 && nitems != 6) {
        PyErr_SetString(PyExc_ValueError,
                        "a target is (head, expected_header, dests, staging, max_len"
                        "[, expected_prefix])");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    t->header_len = -1;
    if (PyObject_GetBuffer(command, &t->command, PyBUF_SIMPLE) < 0) goto done;
    if (get_writable(items[0], &t->head, "head") < 0) goto done;
    if (PyObject_GetBuffer(items[1], &t->expected, PyBUF_SIMPLE) < 0) goto done;
    if (t->head.len < PREFIX_BYTES) {
        PyErr_SetString(PyExc_ValueError, "head must hold at least the 48-byte prefix");
        goto done;
    }
    if (target_dests(t, items[2], ls) < 0) goto done;
    if (items[3] != Py_None) {
        if (get_writable(items[3], &t->staging, "staging") < 0) goto done;
        t->has_staging = 1;
    }
    t->max_len = PyLong_AsLongLong(items[4]);
    if (t->max_len == -1 && PyErr_Occurred()) goto done;
    if (t->max_len < 0) {
        PyErr_SetString(PyExc_ValueError, "max_len must be >= 0");
        goto done;
    }
    if (nitems == 6 && items[5] != Py_None) {
        if (PyObject_GetBuffer(items[5], &t->prefix, PyBUF_SIMPLE) < 0) goto done;
        if (t->prefix.len > PREFIX_BYTES) {
            PyErr_SetString(PyExc_ValueError, "expected_prefix must be at most 48 bytes");
            goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

static PyObject *load_result(target_t *t) {
    PyObject *landed = Py_None;
    if (t->landed == LAND_PAGES) landed = PyUnicode_FromString("pages");
    else if (t->landed == LAND_STAGING) landed = PyUnicode_FromString("staging");
    else Py_INCREF(Py_None);
    if (!landed) return NULL;
    PyObject *error = Py_None;
    if (t->error) error = PyUnicode_DecodeUTF8(t->error, (Py_ssize_t)strlen(t->error), "replace");
    else Py_INCREF(Py_None);
    if (!error) {
        Py_DECREF(landed);
        return NULL;
    }
    return Py_BuildValue("(sLLONN)", load_status_names[t->status], t->value_len, t->header_len,
                         t->crc_ok ? Py_True : Py_False, landed, error);
}

PyDoc_STRVAR(load_values_doc,
             "load_values(fd, commands, targets, timeout_s, window=0, budget_s=0, one_thread=False, "
             "piece_bytes=0) -> list[tuple]\n\n"
             "See hma_redis.core.redis.wire.load_values (the documented wrapper).");

static PyObject *py_load_values(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd",       "commands",   "targets",     "timeout_s", "window",
                             "budget_s", "one_thread", "piece_bytes", NULL};
    PyObject *fd;
    PyObject *commands, *specs;
    double timeout_s, budget_s = 0.0;
    Py_ssize_t window = 0, piece_bytes = 0;
    int one_thread = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOd|ndpn", kwlist, &fd, &commands, &specs,
                                     &timeout_s, &window, &budget_s, &one_thread, &piece_bytes))
        return NULL;
    PyObject *cseq = PySequence_Fast(commands, "commands must be a sequence");
    if (!cseq) return NULL;
    PyObject *tseq = PySequence_Fast(specs, "targets must be a sequence");
    if (!tseq) {
        Py_DECREF(cseq);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tseq);
    target_t *targets = PyMem_Calloc((size_t)n + 1, sizeof(target_t));
    layouts_t layouts = {0}; /* the page layouts of Pages destinations, held for the call */
    conn_t cs[MAX_CONNS];
    size_t k = 0, failed = 0;
    int opened = 0;
    if (!targets) {
        PyErr_NoMemory();
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(cseq) != n) {
        PyErr_SetString(PyExc_ValueError, "one command per target");
        goto done;
    }
    if (window < 0) {
        PyErr_SetString(PyExc_ValueError, "window must be >= 0");
        goto done;
    }
    if (piece_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be >= 0");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        target_t *t = &targets[i];
        if (target_parse(t, PySequence_Fast_GET_ITEM(cseq, i), PySequence_Fast_GET_ITEM(tseq, i),
                         &layouts) < 0)
            goto done;
        if (piece_bytes > 0 && t->max_len > piece_bytes) { /* read in pieces (value_t) */
            t->piece = piece_bytes;
            t->pieces = (size_t)((t->max_len + piece_bytes - 1) / piece_bytes);
        }
    }
    if (conns_open(fd, cs, &k, timeout_s, budget_s) < 0) goto done;
    opened = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (one_thread)
        rc = run_loads(cs, k, targets, (size_t)n, (size_t)window, &failed);
    else
        rc = run_loads_on_threads(cs, k, targets, (size_t)n, (size_t)window, &failed);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        conn_raise(&cs[failed]);
        goto done;
    }
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = load_result(&targets[i]);
        if (!item) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    if (opened) conns_close(cs, k);
    if (targets) {
        for (Py_ssize_t i = 0; i < n; i++) target_release(&targets[i]);
        PyMem_Free(targets);
    }
    layouts_release(&layouts);
    Py_DECREF(cseq);
    Py_DECREF(tseq);
    return out;
}

/* ------------------------------------------------------------------------------------------
 * store_values
 * ---------------------------------------------------------------------------------------- */

enum store_status { S_STORED, S_EXISTED, S_ERROR };
static const char *const store_status_names[] = {"stored", "existed", "error"};

/* One value of a store job: its pieces are iov[first, end): the framing, the head (the codec's
 * prefix and header, whose CRC field this code fills), the pages, the tail. */
typedef struct {
    size_t first, end;
    enum store_status status;
    char *error;
} store_out_t;

static void put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* For each value: CRC32C of header || pages into the head's CRC field, then send its pieces
 * (the pages just checksummed are still in the cache) on connection i % k. Then read one reply
 * per value, in value order. On failure *failed is the connection that failed. */
static int run_stores(conn_t *cs, size_t k, struct iovec *iov, store_out_t *outs, size_t n,
                      size_t *failed) {
    for (size_t i = 0; i < n; i++) {
        uint8_t *head = iov[outs[i].first + 1].iov_base;
        uint32_t crc = crc_update(0xFFFFFFFFu, head + PREFIX_BYTES,
                                  iov[outs[i].first + 1].iov_len - PREFIX_BYTES);
        for (size_t q = outs[i].first + 2; q + 1 < outs[i].end; q++)
            crc = crc_update(crc, iov[q].iov_base, iov[q].iov_len);
        put_be32(head + CRC_OFFSET, crc ^ 0xFFFFFFFFu);
        *failed = i % k;
        if (conn_send(&cs[i % k], iov + outs[i].first, (int)(outs[i].end - outs[i].first)) < 0)
            return -1;
    }
    for (size_t i = 0; i < n; i++) {
        conn_t *c = &cs[i % k];
        *failed = i % k;
        reply_t r;
        if (read_reply_line(c, &r) < 0) return -1;
        if (r.kind == R_STATUS) {
            int ok = strcmp(r.text, "OK") == 0;
            free(r.text);
            if (!ok) return conn_failed(c, FAIL_PROTOCOL, 0, "unexpected status reply to SET");
            outs[i].status = S_STORED;
        } else if (r.kind == R_NIL) {
            outs[i].status = S_EXISTED;
        } else if (r.kind == R_ERROR) {
            outs[i].status = S_ERROR;
            outs[i].error = r.text;
        } else {
            return conn_failed(c, FAIL_PROTOCOL, 0,
                               r.kind == R_INT ? "integer reply to SET NX" : "bulk reply to SET NX");
        }
    }
    return conns_drained(cs, k, failed);
}

/* Hold one piece's buffer (writable for the head) and point the next iovec at it. */
static int store_piece(PyObject *obj, int writable, Py_buffer *views, struct iovec *iov,
                       size_t *count) {
    if (PyObject_GetBuffer(obj, &views[*count], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    iov[*count].iov_base = views[*count].buf;
    iov[*count].iov_len = (size_t)views[*count].len;
    (*count)++;
    return 0;
}

/* Parse one (framing, head, pages, tail) value into views/iov, growing them as needed. */
static int store_parse(PyObject *value, Py_buffer **views, struct iovec **iov, size_t *count,
                       size_t *cap, store_out_t *out, layouts_t *ls) {
    PyObject *vseq = PySequence_Fast(value, "a value is (framing, head, pages, tail)");
    if (!vseq) return -1;
    PyObject *pseq = NULL;
    seg_t *segs = NULL; /* a Pages body's segments */
    size_t nseg = 0;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(vseq) != 4) {
        PyErr_SetString(PyExc_ValueError, "a value is (framing, head, pages, tail)");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(vseq);
    if (PyObject_TypeCheck(items[2], PagesType)) {
        if (pages_segments(ls, items[2], &segs, &nseg) < 0) goto done;
    } else {
        pseq = PySequence_Fast(items[2], "pages must be a sequence of buffers");
        if (!pseq) goto done;
        nseg = (size_t)PySequence_Fast_GET_SIZE(pseq);
    }
    size_t need = *count + nseg + 3;
    if (need > *cap) {
        size_t grown = need * 2 + 16;
        Py_buffer *v2 = PyMem_Realloc(*views, grown * sizeof(Py_buffer));
        if (v2) *views = v2;
        struct iovec *i2 = v2 ? PyMem_Realloc(*iov, grown * sizeof(struct iovec)) : NULL;
        if (i2) *iov = i2;
        if (!v2 || !i2) {
            PyErr_NoMemory();
            goto done;
        }
        *cap = grown;
    }
    out->first = *count;
    if (store_piece(items[0], 0, *views, *iov, count) < 0) goto done;
    if (store_piece(items[1], 1, *views, *iov, count) < 0) {
        PyErr_SetString(PyExc_TypeError, "head must be a writable contiguous buffer");
        goto done;
    }
    if ((*iov)[*count - 1].iov_len < PREFIX_BYTES) {
        PyErr_SetString(PyExc_ValueError, "head must hold at least the 48-byte prefix");
        goto done;
    }
    for (size_t k = 0; k < nseg; k++) {
        if (segs) { /* a page of a Pages body: its layer's memory is held by ``ls`` */
            memset(&(*views)[*count], 0, sizeof(Py_buffer));
            (*iov)[*count].iov_base = segs[k].ptr;
            (*iov)[(*count)++].iov_len = segs[k].len;
        } else if (store_piece(PySequence_Fast_GET_ITEM(pseq, (Py_ssize_t)k), 0, *views, *iov,
                               count) < 0) {
            goto done;
        }
    }
    if (store_piece(items[3], 0, *views, *iov, count) < 0) goto done;
    out->end = *count;
    rc = 0;
done:
    PyMem_Free(segs);
    Py_XDECREF(pseq);
    Py_DECREF(vseq);
    return rc;
}

PyDoc_STRVAR(store_values_doc,
             "store_values(fd, values, timeout_s, budget_s=0) -> list[tuple]\n\n"
             "See hma_redis.core.redis.wire.store_values (the documented wrapper).");

static PyObject *py_store_values(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "values", "timeout_s", "budget_s", NULL};
    PyObject *fd;
    PyObject *values;
    double timeout_s, budget_s = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOd|d", kwlist, &fd, &values, &timeout_s,
                                     &budget_s))
        return NULL;
    PyObject *vseq = PySequence_Fast(values, "values must be a sequence");
    if (!vseq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(vseq);
    PyObject *out = NULL;
    Py_buffer *views = NULL;
    struct iovec *iov = NULL;
    size_t nviews = 0, cap = 0;
    store_out_t *outs = PyMem_Calloc((size_t)n + 1, sizeof(store_out_t));
    layouts_t layouts = {0}; /* the page layouts of Pages bodies, held for the call */
    conn_t cs[MAX_CONNS];
    size_t k = 0, failed = 0;
    int opened = 0;
    if (!outs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (store_parse(PySequence_Fast_GET_ITEM(vseq, i), &views, &iov, &nviews, &cap,
                        &outs[i], &layouts) < 0)
            goto done;
    if (conns_open(fd, cs, &k, timeout_s, budget_s) < 0) goto done;
    opened = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_stores(cs, k, iov, outs, (size_t)n, &failed);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        conn_raise(&cs[failed]);
        goto done;
    }
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item;
        if (outs[i].error)
            item = Py_BuildValue("(sN)", store_status_names[outs[i].status],
                                 PyUnicode_DecodeUTF8(outs[i].error,
                                                      (Py_ssize_t)strlen(outs[i].error),
                                                      "replace"));
        else
            item = Py_BuildValue("(sO)", store_status_names[outs[i].status], Py_None);
        if (!item) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    if (opened) conns_close(cs, k);
    for (size_t q = 0; q < nviews; q++) PyBuffer_Release(&views[q]);
    PyMem_Free(views);
    PyMem_Free(iov);
    layouts_release(&layouts);
    if (outs) {
        for (Py_ssize_t i = 0; i < n; i++) free(outs[i].error);
        PyMem_Free(outs);
    }
    Py_DECREF(vseq);
    return out;
}

/* ------------------------------------------------------------------------------------------
 * crc32c
 * ---------------------------------------------------------------------------------------- */

/* CRC32C of ``n`` buffers from ``value``; GIL released around the bytes. */
/* path: CRC_BEST (what the data path runs), CRC_PORTABLE (the table) or CRC_NO_FOLD (the
 * CRC-instruction loop without the folding one): the last two for tests. */
enum { CRC_BEST, CRC_PORTABLE, CRC_NO_FOLD };

static PyObject *crc_of_views(Py_buffer *views, size_t n, unsigned long value, int path) {
    uint32_t crc = (uint32_t)value ^ 0xFFFFFFFFu;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) {
        const void *buf = views[i].buf;
        size_t len = (size_t)views[i].len;
        crc = path == CRC_PORTABLE  ? crc_sw(crc, buf, len)
              : path == CRC_NO_FOLD ? crc_update_no_fold(crc, buf, len)
                                    : crc_update(crc, buf, len);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc ^ 0xFFFFFFFFu);
}

static int parse_crc_value(PyObject *obj, unsigned long *value) {
    if (!obj) {
        *value = 0;
        return 0;
    }
    *value = PyLong_AsUnsignedLong(obj);
    if (*value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (*value > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "value must be a 32-bit CRC");
        return -1;
    }
    return 0;
}

static PyObject *crc_one(PyObject *args, PyObject *kwargs, int path) {
    static char *kwlist[] = {"data", "value", NULL};
    Py_buffer view;
    PyObject *start = NULL;
    unsigned long value;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|O", kwlist, &view, &start)) return NULL;
    PyObject *out = NULL;
    if (parse_crc_value(start, &value) == 0) out = crc_of_views(&view, 1, value, path);
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, value=0) -> int\n\n"
             "CRC32C of a buffer, continuing from value (as the crc32c package).");

static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kwargs) {
    return crc_one(args, kwargs, CRC_BEST);
}

PyDoc_STRVAR(crc32c_portable_doc,
             "_crc32c_portable(data, value=0) -> int\n\n"
             "crc32c on the portable table path whatever the CPU (for tests).");

static PyObject *py_crc32c_portable(PyObject *self, PyObject *args, PyObject *kwargs) {
    return crc_one(args, kwargs, CRC_PORTABLE);
}

PyDoc_STRVAR(crc32c_no_fold_doc,
             "_crc32c_no_fold(data, value=0) -> int\n\n"
             "crc32c without the folding (VPCLMULQDQ) loop: CRC instructions or the table (for "
             "tests).");

static PyObject *py_crc32c_no_fold(PyObject *self, PyObject *args, PyObject *kwargs) {
    return crc_one(args, kwargs, CRC_NO_FOLD);
}

PyDoc_STRVAR(crc32c_parts_doc,
             "crc32c_parts(buffers, value=0) -> int\n\n"
             "CRC32C of the buffers back to back, in one call with the GIL released.");

static PyObject *py_crc32c_parts(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffers", "value", NULL};
    PyObject *buffers, *start = NULL;
    unsigned long value;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O", kwlist, &buffers, &start)) return NULL;
    if (parse_crc_value(start, &value) < 0) return NULL;
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    PyObject *out = NULL;
    Py_ssize_t held = 0;
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held],
                               PyBUF_SIMPLE) < 0)
            goto done;
    out = crc_of_views(views, (size_t)n, value, CRC_BEST);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return out;
}

static PyObject *py_hardware_crc(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(crc_hw);
}

static PyObject *py_crc_engine(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(crc_fold ? "VPCLMULQDQ folding" : crc_hw ? "SSE4.2" : "");
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS, crc32c_doc},
    {"crc32c_parts", (PyCFunction)(void (*)(void))py_crc32c_parts, METH_VARARGS | METH_KEYWORDS,
     crc32c_parts_doc},
    {"_crc32c_portable", (PyCFunction)(void (*)(void))py_crc32c_portable,
     METH_VARARGS | METH_KEYWORDS, crc32c_portable_doc},
    {"load_values", (PyCFunction)(void (*)(void))py_load_values, METH_VARARGS | METH_KEYWORDS,
     load_values_doc},
    {"store_values", (PyCFunction)(void (*)(void))py_store_values, METH_VARARGS | METH_KEYWORDS,
     store_values_doc},
    {"_crc32c_no_fold", (PyCFunction)(void (*)(void))py_crc32c_no_fold,
     METH_VARARGS | METH_KEYWORDS, crc32c_no_fold_doc},
    {"hardware_crc", py_hardware_crc, METH_NOARGS, "Whether crc32c uses CRC instructions."},
    {"crc_engine", py_crc_engine, METH_NOARGS,
     "The instructions crc32c runs on: 'VPCLMULQDQ folding', 'SSE4.2', or '' (the table)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_wire",
    .m_doc = "Native per-byte work of hma_redis transfers (see hma_redis.core.redis.wire).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__wire(void) {
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    ProtocolError = PyErr_NewExceptionWithDoc(
        "hma_redis.core.redis._wire.ProtocolError",
        "Redis sent bytes that are not the expected RESP reply; drop the connection.",
        PyExc_ConnectionError, NULL);
    if (!ProtocolError || PyModule_AddObject(m, "ProtocolError", ProtocolError) < 0) {
        Py_XDECREF(ProtocolError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(ProtocolError); /* the module's reference was stolen; keep ours */
    PyObject *medium = PyImport_ImportModule("hma_redis.core.medium");
    PyObject *pages = medium ? PyObject_GetAttrString(medium, "Pages") : NULL;
    Py_XDECREF(medium);
    if (!pages || !PyType_Check(pages)) {
        if (pages && !PyErr_Occurred())
            PyErr_SetString(PyExc_ImportError, "hma_redis.core.medium.Pages is not a type");
        Py_XDECREF(pages);
        Py_DECREF(m);
        return NULL;
    }
    PagesType = (PyTypeObject *)pages; /* kept for the process, as ProtocolError */
    return m;
}
